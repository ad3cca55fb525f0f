"""`python -m modelexpress` runs the CLI."""

from modelexpress.cli import main

main()
