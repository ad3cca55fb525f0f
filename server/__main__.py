"""``python -m modelexpress.server``: run the control plane."""

from modelexpress.server.serve import main

main()
