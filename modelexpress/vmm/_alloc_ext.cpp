// modelexpress.vmm._alloc_ext: the allocator shim between PyTorch and a VmmArena.
//
// A plain CPython extension: no libtorch and no CUDA headers are needed to build
// it. It owns the arena's bookkeeping (bump pointer, live-allocation map, in-flight
// counter) and leaves every driver / OS call to the arena's Python backend, which it
// reaches through two callbacks stored in the per-arena state:
//
//   map_cb(va, size) -> handle          create + map + set access, rolled back on failure
//   unmap_cb(va, size, handle) -> None  unmap + release
//
// Why callbacks instead of calling the CUDA driver from C: the same C path then runs
// on the CPU with HostVmmBackend (memfd pages) in CI, and the driver calls keep the
// context handling and the rollback of CudaVmmBackend in one place. The price is one
// Python call per *segment* (the caching allocator hands us segment-sized requests,
// a few hundred per model load), measured by bench/vmm_arena.py.
//
// Two entry points share one core:
//   * mx_malloc / mx_free: C symbols for torch.cuda.CUDAPluggableAllocator. They
//     may run on any thread, with or without the GIL. They take the GIL (RAII guard)
//     only around the callback, never let a Python exception escape (it is recorded
//     in last_error and cleared) and return nullptr on failure, which PyTorch turns
//     into its out-of-memory error.
//   * malloc / free / live / stats / drain / take_all: the Python API used by
//     VmmArena. These raise the arena's own exception types.
//
// Concurrency:
//   * bump pointer: std::atomic, compare-and-swap; a failed mapping gives its slot
//     back only while it is still the top (otherwise the slot stays a hole).
//   * live map: std::map under a mutex; the GIL is released while waiting for it,
//     so a thread holding the mutex never waits for the GIL (no lock-order cycle).
//   * in-flight counter: every call increments it *before* reading `closed` and
//     decrements it on the way out (seq_cst). drain() sets `closed` first and then
//     waits for the counter to reach zero, so after drain() returns 0 no call can
//     touch the live map or a callback any more.
//   * registry: mx_free gets only a pointer, so states are found by address range
//     in a global registry; a state leaves the registry in drain().

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <sys/types.h>

#define MX_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

const char* kCapsuleName = "modelexpress.vmm._alloc_ext.ArenaState";

struct Entry {
  size_t size;
  PyObject* handle;  // strong reference, owned by the entry
};

struct State {
  uintptr_t base = 0;
  size_t total = 0;
  size_t granularity = 1;

  std::atomic<size_t> bump{0};  // offset of the next free slot from base
  std::atomic<bool> closed{false};
  std::atomic<long> in_flight{0};

  std::mutex mu;  // guards live, mapped, last_error
  std::map<uintptr_t, Entry> live;
  size_t mapped = 0;
  std::string last_error;

  std::mutex drain_mu;
  std::condition_variable drain_cv;

  // Strong references; cleared under the GIL by the capsule destructor once drained.
  PyObject* map_cb = nullptr;
  PyObject* unmap_cb = nullptr;

  std::atomic<unsigned long long> mallocs{0}, frees{0}, malloc_failures{0},
      free_failures{0}, late_frees{0};
};

using StatePtr = std::shared_ptr<State>;

// Heap-allocated and never freed: static destructors run after Python is gone, and a
// State must not be destroyed from there.
std::mutex* g_mu = new std::mutex();
std::vector<StatePtr>* g_states = new std::vector<StatePtr>();
StatePtr* g_active = new StatePtr();
std::atomic<unsigned long long> g_unknown_frees{0}, g_null_mallocs{0};

PyObject* g_closed_exc = nullptr;     // ArenaClosedError
PyObject* g_exhausted_exc = nullptr;  // ArenaExhaustedError
PyObject* g_invalid_exc = nullptr;    // InvalidFreeError

bool interpreter_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// RAII: the GIL is held exactly for the guard's scope, on every path out.
class GilGuard {
 public:
  GilGuard() : state_(PyGILState_Ensure()) {}
  ~GilGuard() { PyGILState_Release(state_); }
  GilGuard(const GilGuard&) = delete;
  GilGuard& operator=(const GilGuard&) = delete;

 private:
  PyGILState_STATE state_;
};

// RAII: counts a call in flight; `ok()` is false once the arena is closed.
class InFlight {
 public:
  explicit InFlight(State* s) : s_(s) {
    s_->in_flight.fetch_add(1);
    ok_ = !s_->closed.load();
  }
  ~InFlight() {
    if (s_->in_flight.fetch_sub(1) == 1 && s_->closed.load()) {
      std::lock_guard<std::mutex> lock(s_->drain_mu);
      s_->drain_cv.notify_all();
    }
  }
  bool ok() const { return ok_; }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

 private:
  State* s_;
  bool ok_;
};

bool round_up(size_t size, size_t gran, size_t* out) {
  if (size == 0 || size > SIZE_MAX - (gran - 1)) return false;
  *out = (size + gran - 1) / gran * gran;
  return true;
}

bool bump_alloc(State* s, size_t aligned, uintptr_t* va) {
  size_t cur = s->bump.load();
  do {
    if (aligned > s->total - cur) return false;
  } while (!s->bump.compare_exchange_weak(cur, cur + aligned));
  *va = s->base + cur;
  return true;
}

// Give a slot back only while it is still the top; otherwise it stays a hole.
void bump_undo(State* s, uintptr_t va, size_t aligned) {
  size_t expected = (va - s->base) + aligned;
  s->bump.compare_exchange_strong(expected, va - s->base);
}

void insert_live(State* s, uintptr_t va, size_t aligned, PyObject* handle) {
  std::lock_guard<std::mutex> lock(s->mu);
  s->live.emplace(va, Entry{aligned, handle});
  s->mapped += aligned;
}

bool remove_live(State* s, uintptr_t va, Entry* out) {
  std::lock_guard<std::mutex> lock(s->mu);
  auto it = s->live.find(va);
  if (it == s->live.end()) return false;
  *out = it->second;
  s->mapped -= it->second.size;
  s->live.erase(it);
  return true;
}

// Must hold the GIL; records the pending Python error as text and clears it.
void record_error(State* s, const char* what) {
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  PyErr_Fetch(&type, &value, &tb);
  std::string msg = what;
  if (value != nullptr) {
    PyObject* text = PyObject_Str(value);
    if (text != nullptr) {
      const char* utf8 = PyUnicode_AsUTF8(text);
      if (utf8 != nullptr) msg += std::string(": ") + utf8;
      Py_DECREF(text);
    }
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  std::lock_guard<std::mutex> lock(s->mu);
  s->last_error = msg;
}

StatePtr find_state(uintptr_t va) {
  std::lock_guard<std::mutex> lock(*g_mu);
  for (const StatePtr& s : *g_states) {
    if (va >= s->base && va - s->base < s->total) return s;
  }
  return nullptr;
}

void unregister_state(State* s) {
  std::lock_guard<std::mutex> lock(*g_mu);
  for (auto it = g_states->begin(); it != g_states->end(); ++it) {
    if (it->get() == s) {
      g_states->erase(it);
      break;
    }
  }
  if (g_active->get() == s) g_active->reset();
}

// Waits (without the GIL if the caller holds it) until no call is in flight.
long wait_drained(State* s, double wait_s, bool release_gil) {
  long remaining = 0;
  auto wait = [&]() {
    std::unique_lock<std::mutex> lock(s->drain_mu);
    s->drain_cv.wait_for(lock, std::chrono::duration<double>(wait_s),
                         [s] { return s->in_flight.load() == 0; });
    remaining = s->in_flight.load();
  };
  if (release_gil) {
    Py_BEGIN_ALLOW_THREADS wait();
    Py_END_ALLOW_THREADS
  } else {
    wait();
  }
  return remaining;
}

State* state_from(PyObject* capsule) {
  return static_cast<StatePtr*>(PyCapsule_GetPointer(capsule, kCapsuleName))->get();
}

StatePtr* holder_from(PyObject* capsule) {
  return static_cast<StatePtr*>(PyCapsule_GetPointer(capsule, kCapsuleName));
}

void capsule_destructor(PyObject* capsule) {
  StatePtr* holder = holder_from(capsule);
  if (holder == nullptr) {
    PyErr_Clear();
    return;
  }
  State* s = holder->get();
  s->closed.store(true);
  unregister_state(s);
  // Normally VmmArena.close() already drained and took every entry. If not (the
  // arena was never closed), wait briefly; a call still running after that keeps
  // its references, so leak them rather than free what it may still use.
  if (wait_drained(s, 5.0, true) == 0) {
    for (auto& kv : s->live) Py_XDECREF(kv.second.handle);
    s->live.clear();
    Py_CLEAR(s->map_cb);
    Py_CLEAR(s->unmap_cb);
  }
  delete holder;
}

PyObject* exc_or(PyObject* configured, PyObject* fallback) {
  return configured != nullptr ? configured : fallback;
}

// ---------------------------------------------------------------- Python API

PyObject* py_configure(PyObject*, PyObject* args) {
  PyObject *closed, *exhausted, *invalid;
  if (!PyArg_ParseTuple(args, "OOO", &closed, &exhausted, &invalid)) return nullptr;
  Py_XSETREF(g_closed_exc, Py_NewRef(closed));
  Py_XSETREF(g_exhausted_exc, Py_NewRef(exhausted));
  Py_XSETREF(g_invalid_exc, Py_NewRef(invalid));
  Py_RETURN_NONE;
}

PyObject* py_create(PyObject*, PyObject* args) {
  unsigned long long base, total, gran;
  PyObject *map_cb, *unmap_cb;
  if (!PyArg_ParseTuple(args, "KKKOO", &base, &total, &gran, &map_cb, &unmap_cb)) return nullptr;
  if (gran == 0 || total == 0 || total % gran != 0 || base % gran != 0) {
    PyErr_Format(PyExc_ValueError,
                 "bad arena geometry: base=%llu total=%llu granularity=%llu "
                 "(total and base must be non-zero multiples of the granularity)",
                 base, total, gran);
    return nullptr;
  }
  if (!PyCallable_Check(map_cb) || !PyCallable_Check(unmap_cb)) {
    PyErr_SetString(PyExc_TypeError, "map_cb and unmap_cb must be callable");
    return nullptr;
  }
  auto state = std::make_shared<State>();
  state->base = static_cast<uintptr_t>(base);
  state->total = static_cast<size_t>(total);
  state->granularity = static_cast<size_t>(gran);
  state->map_cb = Py_NewRef(map_cb);
  state->unmap_cb = Py_NewRef(unmap_cb);
  auto* holder = new StatePtr(state);
  PyObject* capsule = PyCapsule_New(holder, kCapsuleName, capsule_destructor);
  if (capsule == nullptr) {
    Py_CLEAR(state->map_cb);
    Py_CLEAR(state->unmap_cb);
    delete holder;
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(*g_mu);
  g_states->push_back(state);
  return capsule;
}

PyObject* py_malloc(PyObject*, PyObject* args) {
  PyObject* capsule;
  unsigned long long size;
  if (!PyArg_ParseTuple(args, "OK", &capsule, &size)) return nullptr;
  State* s = state_from(capsule);
  if (s == nullptr) return nullptr;
  InFlight guard(s);
  if (!guard.ok()) {
    PyErr_SetString(exc_or(g_closed_exc, PyExc_RuntimeError), "malloc on a closed VmmArena");
    return nullptr;
  }
  size_t aligned = 0;
  if (!round_up(static_cast<size_t>(size), s->granularity, &aligned)) {
    PyErr_Format(PyExc_ValueError, "allocation size must be > 0 and representable, got %llu",
                 size);
    return nullptr;
  }
  uintptr_t va = 0;
  bool ok;
  Py_BEGIN_ALLOW_THREADS ok = bump_alloc(s, aligned, &va);
  Py_END_ALLOW_THREADS
  if (!ok) {
    s->malloc_failures.fetch_add(1);
    PyErr_Format(exc_or(g_exhausted_exc, PyExc_MemoryError),
                 "VmmArena exhausted: %zu bytes requested (%zu aligned), %zu of %zu bytes "
                 "of the reserved range used; reserve a larger range",
                 static_cast<size_t>(size), aligned, s->bump.load(), s->total);
    return nullptr;
  }
  PyObject* handle = PyObject_CallFunction(s->map_cb, "KK", (unsigned long long)va,
                                           (unsigned long long)aligned);
  if (handle == nullptr) {
    bump_undo(s, va, aligned);
    s->malloc_failures.fetch_add(1);
    return nullptr;  // the backend's exception propagates unchanged
  }
  Py_BEGIN_ALLOW_THREADS insert_live(s, va, aligned, handle);
  Py_END_ALLOW_THREADS
  s->mallocs.fetch_add(1);
  return PyLong_FromUnsignedLongLong(va);
}

PyObject* py_free(PyObject*, PyObject* args) {
  PyObject* capsule;
  unsigned long long va;
  if (!PyArg_ParseTuple(args, "OK", &capsule, &va)) return nullptr;
  State* s = state_from(capsule);
  if (s == nullptr) return nullptr;
  InFlight guard(s);
  if (!guard.ok()) {
    PyErr_SetString(exc_or(g_closed_exc, PyExc_RuntimeError), "free on a closed VmmArena");
    return nullptr;
  }
  Entry entry{};
  bool found;
  Py_BEGIN_ALLOW_THREADS found = remove_live(s, static_cast<uintptr_t>(va), &entry);
  Py_END_ALLOW_THREADS
  if (!found) {
    PyErr_Format(exc_or(g_invalid_exc, PyExc_ValueError),
                 "free(0x%llx): not a live allocation of this arena (never allocated, "
                 "already freed, or not the start of an allocation)",
                 va);
    return nullptr;
  }
  PyObject* res = PyObject_CallFunction(s->unmap_cb, "KKO", va,
                                        (unsigned long long)entry.size, entry.handle);
  Py_DECREF(entry.handle);
  if (res == nullptr) {
    s->free_failures.fetch_add(1);
    return nullptr;
  }
  Py_DECREF(res);
  s->frees.fetch_add(1);
  return PyLong_FromSize_t(entry.size);
}

PyObject* py_live(PyObject*, PyObject* capsule) {
  State* s = state_from(capsule);
  if (s == nullptr) return nullptr;
  std::vector<std::pair<uintptr_t, size_t>> copy;
  Py_BEGIN_ALLOW_THREADS {
    std::lock_guard<std::mutex> lock(s->mu);
    copy.reserve(s->live.size());
    for (const auto& kv : s->live) copy.emplace_back(kv.first, kv.second.size);
  }
  Py_END_ALLOW_THREADS
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(copy.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < copy.size(); ++i) {
    PyObject* item = Py_BuildValue("(KK)", (unsigned long long)copy[i].first,
                                   (unsigned long long)copy[i].second);
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}

PyObject* py_stats(PyObject*, PyObject* capsule) {
  State* s = state_from(capsule);
  if (s == nullptr) return nullptr;
  size_t live, mapped;
  std::string last_error;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    live = s->live.size();
    mapped = s->mapped;
    last_error = s->last_error;
  }
  return Py_BuildValue(
      "{s:K,s:K,s:K,s:K,s:K,s:l,s:n,s:K,s:K,s:O,s:s}", "mallocs", s->mallocs.load(), "frees",
      s->frees.load(), "malloc_failures", s->malloc_failures.load(), "free_failures",
      s->free_failures.load(), "late_frees", s->late_frees.load(), "in_flight",
      s->in_flight.load(), "live", (Py_ssize_t)live, "mapped_bytes", (unsigned long long)mapped,
      "used_bytes", (unsigned long long)s->bump.load(), "closed",
      s->closed.load() ? Py_True : Py_False, "last_error", last_error.c_str());
}

PyObject* py_drain(PyObject*, PyObject* args) {
  PyObject* capsule;
  double wait_s;
  if (!PyArg_ParseTuple(args, "Od", &capsule, &wait_s)) return nullptr;
  State* s = state_from(capsule);
  if (s == nullptr) return nullptr;
  s->closed.store(true);  // before waiting: see InFlight for the ordering
  unregister_state(s);
  return PyLong_FromLong(wait_drained(s, wait_s, true));
}

PyObject* py_take_all(PyObject*, PyObject* capsule) {
  State* s = state_from(capsule);
  if (s == nullptr) return nullptr;
  if (!s->closed.load() || s->in_flight.load() != 0) {
    PyErr_SetString(PyExc_RuntimeError, "take_all needs a drained arena (call drain first)");
    return nullptr;
  }
  std::map<uintptr_t, Entry> taken;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    taken.swap(s->live);
    s->mapped = 0;
  }
  PyObject* list = PyList_New(0);
  if (list == nullptr) return nullptr;  // entries leak: only on out-of-memory
  for (auto& kv : taken) {
    // "N" steals the entry's reference to the handle.
    PyObject* item = Py_BuildValue("(KKN)", (unsigned long long)kv.first,
                                   (unsigned long long)kv.second.size, kv.second.handle);
    if (item == nullptr || PyList_Append(list, item) != 0) {
      Py_XDECREF(item);
      Py_DECREF(list);
      return nullptr;
    }
    Py_DECREF(item);
  }
  return list;
}

PyObject* py_set_active(PyObject*, PyObject* capsule) {
  std::lock_guard<std::mutex> lock(*g_mu);
  if (capsule == Py_None) {
    g_active->reset();
    Py_RETURN_TRUE;
  }
  StatePtr* holder = holder_from(capsule);
  if (holder == nullptr) return nullptr;
  if (*g_active || (*holder)->closed.load()) Py_RETURN_FALSE;  // nesting refused
  *g_active = *holder;
  Py_RETURN_TRUE;
}

PyObject* py_global_stats(PyObject*, PyObject*) {
  bool active;
  size_t registered;
  {
    std::lock_guard<std::mutex> lock(*g_mu);
    active = static_cast<bool>(*g_active);
    registered = g_states->size();
  }
  return Py_BuildValue("{s:K,s:K,s:O,s:n}", "unknown_frees", g_unknown_frees.load(),
                       "null_mallocs", g_null_mallocs.load(), "active",
                       active ? Py_True : Py_False, "registered", (Py_ssize_t)registered);
}

// ctypes-callable test hooks: they run the exact C entry points PyTorch calls.
PyObject* py_symbol_addresses(PyObject*, PyObject*);

PyMethodDef kMethods[] = {
    {"configure", py_configure, METH_VARARGS,
     "configure(closed_exc, exhausted_exc, invalid_free_exc): exception types to raise."},
    {"create", py_create, METH_VARARGS,
     "create(base, total, granularity, map_cb, unmap_cb) -> capsule with the arena state."},
    {"malloc", py_malloc, METH_VARARGS, "malloc(state, size) -> va (calls map_cb)."},
    {"free", py_free, METH_VARARGS, "free(state, va) -> size (calls unmap_cb)."},
    {"live", py_live, METH_O, "live(state) -> [(va, size)] sorted by va."},
    {"stats", py_stats, METH_O, "stats(state) -> dict of counters."},
    {"drain", py_drain, METH_VARARGS,
     "drain(state, wait_s) -> calls still in flight; marks the state closed first."},
    {"take_all", py_take_all, METH_O,
     "take_all(state) -> [(va, size, handle)]: empties a drained state's live map."},
    {"set_active", py_set_active, METH_O,
     "set_active(state | None) -> bool: the state mx_malloc serves; False if one is active."},
    {"global_stats", py_global_stats, METH_NOARGS, "global_stats() -> dict."},
    {"symbol_addresses", py_symbol_addresses, METH_NOARGS,
     "symbol_addresses() -> (mx_malloc, mx_free) function addresses."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef_Slot kSlots[] = {
#ifdef Py_mod_multiple_interpreters
    // Process-global registry: one interpreter only.
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
#ifdef Py_mod_gil
    // Every shared structure is an atomic or mutex-protected; no reliance on the GIL.
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT,
                       "_alloc_ext",
                       "VMM arena allocator shim for torch.cuda.CUDAPluggableAllocator.",
                       0,
                       kMethods,
                       kSlots,
                       nullptr,
                       nullptr,
                       nullptr};

}  // namespace

// ------------------------------------------------------- PyTorch entry points

MX_EXPORT void* mx_malloc(ssize_t size, int device, void* stream) {
  (void)device;
  (void)stream;
  if (size <= 0) return nullptr;
  StatePtr state;
  {
    std::lock_guard<std::mutex> lock(*g_mu);
    state = *g_active;
  }
  if (!state) {
    g_null_mallocs.fetch_add(1);
    return nullptr;
  }
  State* s = state.get();
  InFlight guard(s);
  size_t aligned = 0;
  uintptr_t va = 0;
  if (!guard.ok() || !round_up(static_cast<size_t>(size), s->granularity, &aligned) ||
      !bump_alloc(s, aligned, &va)) {
    s->malloc_failures.fetch_add(1);
    return nullptr;
  }
  PyObject* handle = nullptr;
  if (interpreter_alive()) {
    GilGuard gil;
    handle = PyObject_CallFunction(s->map_cb, "KK", (unsigned long long)va,
                                   (unsigned long long)aligned);
    if (handle == nullptr) record_error(s, "mx_malloc: map callback failed");
  }
  if (handle == nullptr) {
    bump_undo(s, va, aligned);
    s->malloc_failures.fetch_add(1);
    return nullptr;
  }
  insert_live(s, va, aligned, handle);
  s->mallocs.fetch_add(1);
  return reinterpret_cast<void*>(va);
}

MX_EXPORT void mx_free(void* ptr, ssize_t size, int device, void* stream) {
  (void)size;
  (void)device;
  (void)stream;
  uintptr_t va = reinterpret_cast<uintptr_t>(ptr);
  StatePtr state = find_state(va);
  if (!state) {
    // Not (or no longer) an arena of ours: a free after close. The arena already
    // unmapped everything; there is nothing left to release.
    g_unknown_frees.fetch_add(1);
    return;
  }
  State* s = state.get();
  InFlight guard(s);
  Entry entry{};
  if (!guard.ok()) {
    s->late_frees.fetch_add(1);
    return;
  }
  if (!remove_live(s, va, &entry)) {
    g_unknown_frees.fetch_add(1);
    return;
  }
  if (!interpreter_alive()) return;  // exiting: the OS reclaims the mapping
  GilGuard gil;
  PyObject* res = PyObject_CallFunction(s->unmap_cb, "KKO", (unsigned long long)va,
                                        (unsigned long long)entry.size, entry.handle);
  if (res == nullptr) {
    record_error(s, "mx_free: unmap callback failed");
    s->free_failures.fetch_add(1);
  } else {
    Py_DECREF(res);
    s->frees.fetch_add(1);
  }
  Py_DECREF(entry.handle);
}

namespace {
PyObject* py_symbol_addresses(PyObject*, PyObject*) {
  return Py_BuildValue("(KK)", (unsigned long long)reinterpret_cast<uintptr_t>(&mx_malloc),
                       (unsigned long long)reinterpret_cast<uintptr_t>(&mx_free));
}
}  // namespace

PyMODINIT_FUNC PyInit__alloc_ext(void) { return PyModuleDef_Init(&kModule); }
