// XLA FFI handler "jax_cute_launch": runs a CuTe-DSL-compiled launcher from JAX.
//
// The launcher arrives as an ELF object (the DSL's dump_to_object) in the custom call's
// attributes. NVIDIA's libcute_dsl_runtime.so JIT-links it and runs it; we never ship or link
// that library: Python hands us its path and we dlopen it. The CUDA driver is dlopened too, so
// building this file needs neither the CUDA toolkit nor any DSL header.
//
// Stages:
//   instantiate  parse and validate the attributes once per custom call into a LaunchState.
//   initialize   load the kernel's module for this device (once per process and device; host
//                work that CUDA graph replays would skip) and check the compute capability.
//   execute      fill the argument descriptors with buffer pointers and run the launcher.
//   record       (jaxlib 0.11+) hand XLA's command buffer the launcher's kernel node itself.
//
// The argument convention is documented in jax_cute/kernels/abi.py (PackedArgs).

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cinttypes>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla/ffi/api/ffi.h"

// jaxlib 0.11 and newer let a handler record its kernels into XLA's command buffers itself.
#if __has_include("xla/ffi/api/record_c_api.h")
#include "xla/ffi/api/record_c_api.h"
#define JAX_CUTE_HAVE_RECORD 1
#else
#define JAX_CUTE_HAVE_RECORD 0
#endif

namespace nb = nanobind;
namespace ffi = xla::ffi;

// CUDA's stream handle, declared here so no CUDA header is needed.
struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace jax_cute {
namespace {

// ------------------------------------------------------------------------------------------
// Small helpers
// ------------------------------------------------------------------------------------------

std::string Format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string Format(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return buf;
}

ffi::Error Err(ffi::ErrorCode code, std::string message) {
  return ffi::Error(code, "jax_cute: " + std::move(message));
}

// A library opened with dlopen whose entry points are bound one by one; the first failure
// (library absent, symbols missing) becomes the error, naming `what` and every missing symbol.
class LibraryBinder {
 public:
  LibraryBinder(const std::string& path, int flags, std::string what)
      : what_(std::move(what)), lib_(dlopen(path.c_str(), flags)) {
    if (lib_ == nullptr) {
      const char* why = dlerror();
      open_error_ = "cannot load " + what_ + ": " + (why ? why : "?");
    }
  }

  template <typename Fn>
  void Bind(const char* name, Fn* fn) {
    *fn = lib_ == nullptr ? nullptr : reinterpret_cast<Fn>(dlsym(lib_, name));
    if (*fn == nullptr) missing_ += std::string(missing_.empty() ? "" : ", ") + name;
  }

  ffi::Error Status() const {
    if (!open_error_.empty()) return Err(ffi::ErrorCode::kFailedPrecondition, open_error_);
    if (!missing_.empty()) {
      return Err(ffi::ErrorCode::kFailedPrecondition, what_ + " lacks " + missing_);
    }
    return ffi::Error::Success();
  }

 private:
  std::string what_;
  void* lib_;
  std::string open_error_;
  std::string missing_;
};

// ------------------------------------------------------------------------------------------
// CUDA driver, loaded at run time (only the handful of entry points we need)
// ------------------------------------------------------------------------------------------

using CUresult = int;
using CUdevice = int;
struct CUctx_st;
using CUcontext = CUctx_st*;
constexpr int kAttrComputeCapabilityMajor = 75;  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
constexpr int kAttrComputeCapabilityMinor = 76;  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR

struct Driver {
  CUresult (*Init)(unsigned);
  CUresult (*DeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*StreamGetCtx)(cudaStream_t, CUcontext*);
  CUresult (*CtxGetCurrent)(CUcontext*);
  CUresult (*CtxGetDevice)(CUdevice*);
  CUresult (*CtxPushCurrent)(CUcontext);
  CUresult (*CtxPopCurrent)(CUcontext*);
  CUresult (*GetErrorName)(CUresult, const char**);
  CUresult (*GetErrorString)(CUresult, const char**);

  std::string Describe(CUresult r) const {
    const char* name = nullptr;
    const char* text = nullptr;
    if (GetErrorName(r, &name) != 0 || name == nullptr) name = "unknown CUDA error";
    if (GetErrorString(r, &text) != 0 || text == nullptr) text = "";
    return Format("%s (%d): %s", name, r, text);
  }
};

// Both libraries are loaded once and kept for the life of the process.
std::mutex g_load_mu;
std::atomic<const Driver*> g_driver{nullptr};

ffi::Error GetDriver(const Driver** out) {
  if ((*out = g_driver.load(std::memory_order_acquire)) != nullptr) return ffi::Error::Success();
  std::lock_guard<std::mutex> lock(g_load_mu);
  if ((*out = g_driver.load(std::memory_order_relaxed)) != nullptr) return ffi::Error::Success();
  LibraryBinder lib("libcuda.so.1", RTLD_NOW | RTLD_LOCAL, "the CUDA driver libcuda.so.1");
  auto d = std::make_unique<Driver>();
  // The _v2 names are what cuda.h maps the plain names to.
  lib.Bind("cuInit", &d->Init);
  lib.Bind("cuDeviceGetAttribute", &d->DeviceGetAttribute);
  lib.Bind("cuStreamGetCtx", &d->StreamGetCtx);
  lib.Bind("cuCtxGetCurrent", &d->CtxGetCurrent);
  lib.Bind("cuCtxGetDevice", &d->CtxGetDevice);
  lib.Bind("cuCtxPushCurrent_v2", &d->CtxPushCurrent);
  lib.Bind("cuCtxPopCurrent_v2", &d->CtxPopCurrent);
  lib.Bind("cuGetErrorName", &d->GetErrorName);
  lib.Bind("cuGetErrorString", &d->GetErrorString);
  if (ffi::Error e = lib.Status(); e.failure()) return e;
  if (CUresult r = d->Init(0); r != 0) {
    return Err(ffi::ErrorCode::kFailedPrecondition, "cuInit failed: " + d->Describe(r));
  }
  *out = d.release();
  g_driver.store(*out, std::memory_order_release);
  return ffi::Error::Success();
}

// Makes the context of `stream` current on this thread for the guard's lifetime, unless it
// already is (the common case under XLA, which costs one query).
class ScopedStreamContext {
 public:
  ffi::Error Enter(const Driver& d, cudaStream_t stream) {
    CUcontext want = nullptr;
    CUcontext have = nullptr;
    if (CUresult r = d.StreamGetCtx(stream, &want); r != 0) {
      return Err(ffi::ErrorCode::kInternal, "cuStreamGetCtx failed: " + d.Describe(r));
    }
    if (d.CtxGetCurrent(&have) == 0 && have == want) return ffi::Error::Success();
    if (CUresult r = d.CtxPushCurrent(want); r != 0) {
      return Err(ffi::ErrorCode::kInternal, "cuCtxPushCurrent failed: " + d.Describe(r));
    }
    driver_ = &d;
    return ffi::Error::Success();
  }
  ~ScopedStreamContext() {
    if (driver_ != nullptr) {
      CUcontext popped;
      driver_->CtxPopCurrent(&popped);
    }
  }

 private:
  const Driver* driver_ = nullptr;
};

// ------------------------------------------------------------------------------------------
// The CuTe DSL runtime (libcute_dsl_runtime.so), loaded from the path Python gives us
// ------------------------------------------------------------------------------------------

// Opaque handles and signatures of the runtime's C API; its error codes are plain ints here
// (0 is success).
struct DslModule;
struct DslFunction;

struct DslRuntime {
  int (*ModuleCreateFromBytes)(DslModule**, const unsigned char*, size_t, const char**, size_t);
  int (*ModuleGetFunction)(DslFunction**, DslModule*, const char*);
  int (*FunctionRun)(void*, void**, size_t);
  int (*ModuleDestroy)(DslModule*);
  const char* (*GetErrorName)(int);
  const char* (*GetErrorString)(int);

  std::string Describe(int code) const {
    const char* name = GetErrorName(code);
    const char* text = GetErrorString(code);
    return Format("%s (%d): %s", name ? name : "?", code, text ? text : "");
  }
};

std::string g_runtime_path;  // guarded by g_load_mu
std::atomic<const DslRuntime*> g_runtime{nullptr};

ffi::Error GetRuntime(const DslRuntime** out) {
  if ((*out = g_runtime.load(std::memory_order_acquire)) != nullptr) return ffi::Error::Success();
  std::lock_guard<std::mutex> lock(g_load_mu);
  if ((*out = g_runtime.load(std::memory_order_relaxed)) != nullptr) return ffi::Error::Success();
  if (g_runtime_path.empty()) {
    return Err(ffi::ErrorCode::kFailedPrecondition,
               "the CuTe DSL runtime library path is not set (call "
               "jax_cute.runtime.ensure_registered() before running kernels)");
  }
  // RTLD_GLOBAL: the objects the runtime JIT-links resolve their helpers against it.
  LibraryBinder lib(g_runtime_path, RTLD_NOW | RTLD_GLOBAL, "the CuTe DSL runtime " + g_runtime_path);
  auto rt = std::make_unique<DslRuntime>();
  lib.Bind("CuteDSLRT_Module_Create_From_Bytes", &rt->ModuleCreateFromBytes);
  lib.Bind("CuteDSLRT_Module_Get_Function", &rt->ModuleGetFunction);
  lib.Bind("CuteDSLRT_Function_Run", &rt->FunctionRun);
  lib.Bind("CuteDSLRT_Module_Destroy", &rt->ModuleDestroy);
  lib.Bind("CuteDSLRT_GetErrorName", &rt->GetErrorName);
  lib.Bind("CuteDSLRT_GetErrorString", &rt->GetErrorString);
  if (ffi::Error e = lib.Status(); e.failure()) return e;
  *out = rt.release();
  g_runtime.store(*out, std::memory_order_release);
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------------------
// Checking an object for a function prefix
// ------------------------------------------------------------------------------------------

// True when the ELF64 little-endian object `obj` defines a symbol named exactly `name`.
// We read the symbol table rather than search bytes: string tables may share tails, so a
// byte search could not tell "jc_a_version" from a longer name ending in it.
bool ElfDefinesSymbol(const uint8_t* obj, size_t size, std::string_view name) {
  auto read = [&](size_t off, size_t len, void* dst) {
    if (off > size || len > size - off) return false;
    std::memcpy(dst, obj + off, len);
    return true;
  };
  const uint8_t kMagic[4] = {0x7f, 'E', 'L', 'F'};
  if (size < 64 || std::memcmp(obj, kMagic, 4) != 0 || obj[4] != 2 /*64-bit*/ ||
      obj[5] != 1 /*little endian*/) {
    return false;
  }
  uint64_t shoff = 0;
  uint16_t shentsize = 0, shnum = 0;
  if (!read(0x28, 8, &shoff) || !read(0x3a, 2, &shentsize) || !read(0x3c, 2, &shnum)) return false;
  if (shentsize < 64) return false;
  for (uint16_t i = 0; i < shnum; ++i) {
    const size_t sh = shoff + size_t{i} * shentsize;
    uint32_t type = 0, link = 0;
    uint64_t off = 0, len = 0, entsize = 0;
    if (!read(sh + 4, 4, &type) || type != 2 /*SHT_SYMTAB*/) continue;
    if (!read(sh + 24, 8, &off) || !read(sh + 32, 8, &len) || !read(sh + 40, 4, &link) ||
        !read(sh + 56, 8, &entsize) || entsize < 24 || link >= shnum) {
      return false;
    }
    uint64_t str_off = 0, str_len = 0;
    const size_t strsh = shoff + size_t{link} * shentsize;
    if (!read(strsh + 24, 8, &str_off) || !read(strsh + 32, 8, &str_len)) return false;
    if (str_off > size || str_len > size - str_off) return false;
    const char* strtab = reinterpret_cast<const char*>(obj + str_off);
    for (uint64_t s = 0; s + entsize <= len; s += entsize) {
      uint32_t st_name = 0;
      uint16_t st_shndx = 0;
      if (!read(off + s, 4, &st_name) || !read(off + s + 6, 2, &st_shndx)) return false;
      if (st_shndx == 0 /*undefined*/ || st_name >= str_len) continue;
      const size_t max_len = str_len - st_name;
      const size_t n = strnlen(strtab + st_name, max_len);
      if (n < max_len && std::string_view(strtab + st_name, n) == name) return true;
    }
  }
  return false;
}

// The runtime aborts the whole process (an uncaught C++ exception) when asked for a prefix
// the module lacks, so we check first for the data symbols every dumped launcher defines.
bool ObjectHasFunction(const uint8_t* obj, size_t size, const std::string& prefix) {
  return !prefix.empty() && ElfDefinesSymbol(obj, size, prefix + "_function_name") &&
         ElfDefinesSymbol(obj, size, prefix + "_version");
}

// ------------------------------------------------------------------------------------------
// Counters (exposed to Python as stats())
// ------------------------------------------------------------------------------------------

std::atomic<int64_t> g_modules_created{0};
std::atomic<int64_t> g_functions_loaded{0};
std::atomic<int64_t> g_launches{0};

// ------------------------------------------------------------------------------------------
// Per-process registry: one module and function per (object digest, symbol, device)
// ------------------------------------------------------------------------------------------

struct LoadedKernel {
  DslModule* module = nullptr;
  DslFunction* function = nullptr;
};

std::mutex g_registry_mu;
// Entries are never destroyed: kernels may be needed until exit, and unloading CUDA code
// while the process tears CUDA down is a known source of crashes at exit.
using RegistryKey = std::tuple<std::string, std::string, int32_t>;  // key, symbol, device
std::map<RegistryKey, LoadedKernel>* g_registry = new std::map<RegistryKey, LoadedKernel>();

constexpr int kMaxCachedDevices = 64;

// Everything instantiate parsed from the attributes; read-only afterwards except for the
// per-device function cache, which only holds atomics.
struct LaunchState {
  static ffi::TypeId id;

  std::string name;     // for error messages
  std::string key;      // sha256 of the object, hex
  std::string symbol;   // function prefix inside the object
  int64_t arch_major = 0;
  int64_t arch_minor = 0;
  std::vector<int64_t> kinds;    // per argument: -1 stream, -2 scalar, k >= 0 buffer k
  std::vector<int64_t> offsets;  // kinds.size() + 1 offsets into words
  std::vector<int64_t> words;    // descriptor templates
  std::vector<int64_t> align;    // per argument: required byte alignment of the buffer (0: none)
  int64_t min_buffers = 0;       // 1 + the largest buffer index used
  // The kernel waits for the grid before it (griddepcontrol.wait) before touching memory, so
  // a graph may start it early: recorded launches get a programmatic edge (see Record).
  bool uses_pdl = false;

  // Record stage: the buffer addresses each command we recorded was last given (a command is
  // XLA's kernel node in one command buffer; one state may be recorded into several).
  bool RecordedWith(const void* command, const std::vector<void*>& addresses) const {
    std::lock_guard<std::mutex> lock(recorded_mu);
    auto it = recorded.find(command);
    return it != recorded.end() && it->second == addresses;
  }
  void Remember(const void* command, std::vector<void*> addresses) {
    std::lock_guard<std::mutex> lock(recorded_mu);
    recorded[command] = std::move(addresses);
  }
  mutable std::mutex recorded_mu;
  std::map<const void*, std::vector<void*>> recorded;
  // Functions already resolved for device d (nullptr: ask the registry).
  std::array<std::atomic<DslFunction*>, kMaxCachedDevices> by_device{};

  DslFunction* Cached(int32_t device) const {
    if (device < 0 || device >= kMaxCachedDevices) return nullptr;
    return by_device[device].load(std::memory_order_acquire);
  }
  void Cache(int32_t device, DslFunction* fn) {
    if (device >= 0 && device < kMaxCachedDevices) {
      by_device[device].store(fn, std::memory_order_release);
    }
  }
};

ffi::TypeId LaunchState::id = {};

std::string ArchName(int64_t major, int64_t minor) {
  return Format("sm_%" PRId64 "%" PRId64, major, minor);
}

// Checks that the device behind `stream` (its context must be current) has the compute
// capability the state's object was compiled for: the object holds SASS for that arch only.
// Done per state, not per registry entry, so a call site that declares the wrong arch for an
// object already loaded is still refused.
ffi::Error CheckArch(const Driver& d, const LaunchState& state, int32_t device) {
  CUdevice dev = 0;
  int major = 0, minor = 0;
  if (CUresult r = d.CtxGetDevice(&dev); r != 0) {
    return Err(ffi::ErrorCode::kInternal, "cuCtxGetDevice failed: " + d.Describe(r));
  }
  if (CUresult r = d.DeviceGetAttribute(&major, kAttrComputeCapabilityMajor, dev); r != 0) {
    return Err(ffi::ErrorCode::kInternal, "cuDeviceGetAttribute failed: " + d.Describe(r));
  }
  if (CUresult r = d.DeviceGetAttribute(&minor, kAttrComputeCapabilityMinor, dev); r != 0) {
    return Err(ffi::ErrorCode::kInternal, "cuDeviceGetAttribute failed: " + d.Describe(r));
  }
  if (major != state.arch_major || minor != state.arch_minor) {
    return Err(ffi::ErrorCode::kFailedPrecondition,
               Format("kernel %s was compiled for %s (compute capability %" PRId64 ".%" PRId64
                      "), device %d is compute capability %d.%d",
                      state.name.c_str(), ArchName(state.arch_major, state.arch_minor).c_str(),
                      state.arch_major, state.arch_minor, device, major, minor));
  }
  return ffi::Error::Success();
}

// Finds the function of `state` for `device`: checks the arch, then takes the registry's
// module for (state.key, device), creating it exactly once per process. Creating needs the
// device's context current, because the function lookup loads the CUDA library into it.
ffi::Error ResolveFunction(LaunchState& state, ffi::Span<const uint8_t> object, int32_t device,
                           cudaStream_t stream, DslFunction** out) {
  const Driver* d = nullptr;
  const DslRuntime* rt = nullptr;
  if (ffi::Error e = GetDriver(&d); e.failure()) return e;
  if (ffi::Error e = GetRuntime(&rt); e.failure()) return e;
  ScopedStreamContext context;
  if (ffi::Error e = context.Enter(*d, stream); e.failure()) return e;
  if (ffi::Error e = CheckArch(*d, state, device); e.failure()) return e;

  std::lock_guard<std::mutex> lock(g_registry_mu);
  const RegistryKey registry_key{state.key, state.symbol, device};
  auto it = g_registry->find(registry_key);
  if (it != g_registry->end()) {
    *out = it->second.function;
    state.Cache(device, *out);
    return ffi::Error::Success();
  }

  // Checked at instantiation already; checked again because a failure here aborts.
  if (!ObjectHasFunction(object.begin(), object.size(), state.symbol)) {
    return Err(ffi::ErrorCode::kInvalidArgument,
               "kernel " + state.name + ": its object defines no function '" + state.symbol + "'");
  }

  LoadedKernel loaded;
  int rc = 0;
  try {
    rc = rt->ModuleCreateFromBytes(&loaded.module, object.begin(), object.size(), nullptr, 0);
  } catch (...) {
    return Err(ffi::ErrorCode::kInternal,
               "kernel " + state.name + ": the CuTe DSL runtime threw while loading its object");
  }
  if (rc != 0 || loaded.module == nullptr) {
    return Err(ffi::ErrorCode::kInternal, "kernel " + state.name +
                                              ": CuteDSLRT_Module_Create_From_Bytes failed: " +
                                              rt->Describe(rc));
  }
  g_modules_created.fetch_add(1, std::memory_order_relaxed);
  bool threw = false;
  try {
    rc = rt->ModuleGetFunction(&loaded.function, loaded.module, state.symbol.c_str());
  } catch (...) {
    threw = true;
  }
  if (threw || rc != 0 || loaded.function == nullptr) {
    std::string why = threw ? std::string("the runtime threw") : rt->Describe(rc);
    rt->ModuleDestroy(loaded.module);
    return Err(ffi::ErrorCode::kInternal, "kernel " + state.name +
                                              ": CuteDSLRT_Module_Get_Function('" + state.symbol +
                                              "') failed on device " + std::to_string(device) +
                                              ": " + why);
  }
  g_functions_loaded.fetch_add(1, std::memory_order_relaxed);
  g_registry->emplace(registry_key, loaded);
  *out = loaded.function;
  state.Cache(device, *out);
  return ffi::Error::Success();
}

ffi::Error CheckBufferCount(const LaunchState& state, size_t num_buffers) {
  if (state.min_buffers > static_cast<int64_t>(num_buffers)) {
    return Err(ffi::ErrorCode::kInvalidArgument,
               Format("kernel %s: arguments refer to buffer %" PRId64
                      ", but the call has only %zu buffers",
                      state.name.c_str(), state.min_buffers - 1, num_buffers));
  }
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------------------
// Stage 1: instantiate (attributes only; no device, stream or buffers yet)
// ------------------------------------------------------------------------------------------

ffi::ErrorOr<std::unique_ptr<LaunchState>> ParseState(
    std::string_view name, std::string_view key, std::string_view symbol,
    ffi::Span<const uint8_t> object, int64_t arch_major, int64_t arch_minor,
    ffi::Span<const int64_t> kinds, ffi::Span<const int64_t> offsets,
    ffi::Span<const int64_t> words, ffi::Span<const int64_t> align, bool uses_pdl) {
  auto bad = [&](const std::string& why) {
    return ffi::Unexpected(Err(ffi::ErrorCode::kInvalidArgument,
                               "kernel " + std::string(name) + ": malformed call: " + why));
  };
  const size_t n = kinds.size();
  if (offsets.size() != n + 1) {
    return bad(Format("arg_offsets has %zu entries, arg_kinds %zu", offsets.size(), n));
  }
  if (align.size() != n) return bad(Format("arg_align has %zu entries, arg_kinds %zu", align.size(), n));
  if (offsets[0] != 0) return bad("arg_offsets must start at 0");
  if (offsets[n] != static_cast<int64_t>(words.size())) {
    return bad(Format("arg_offsets ends at %" PRId64 " but arg_words has %zu words", offsets[n],
                      words.size()));
  }
  auto state = std::make_unique<LaunchState>();
  for (size_t i = 0; i < n; ++i) {
    const int64_t width = offsets[i + 1] - offsets[i];
    if (width < 0) return bad(Format("arg_offsets decreases at argument %zu", i));
    if (kinds[i] < -2) return bad(Format("argument %zu has unknown kind %" PRId64, i, kinds[i]));
    if (width < 1) return bad(Format("argument %zu has no descriptor words", i));
    if (align[i] < 0 || (align[i] & (align[i] - 1)) != 0) {
      return bad(Format("argument %zu: alignment %" PRId64 " is not a power of two", i, align[i]));
    }
    if (kinds[i] >= 0) state->min_buffers = std::max(state->min_buffers, kinds[i] + 1);
  }
  if (arch_major <= 0 || arch_major > 99 || arch_minor < 0 || arch_minor > 9) {
    return bad(Format("arch %" PRId64 ".%" PRId64 " is not a compute capability", arch_major,
                      arch_minor));
  }
  if (key.empty()) return bad("empty key");
  if (!ObjectHasFunction(object.begin(), object.size(), std::string(symbol))) {
    return ffi::Unexpected(Err(
        ffi::ErrorCode::kInvalidArgument,
        "kernel " + std::string(name) + ": its object (" + std::to_string(object.size()) +
            " bytes) is not an ELF object defining function '" + std::string(symbol) + "'"));
  }
  state->name = std::string(name);
  state->key = std::string(key);
  state->symbol = std::string(symbol);
  state->arch_major = arch_major;
  state->arch_minor = arch_minor;
  state->kinds.assign(kinds.begin(), kinds.end());
  state->offsets.assign(offsets.begin(), offsets.end());
  state->words.assign(words.begin(), words.end());
  state->align.assign(align.begin(), align.end());
  state->uses_pdl = uses_pdl;
  return ffi::ErrorOr<std::unique_ptr<LaunchState>>(std::move(state));
}

// The attributes arrive as a dictionary so that optional ones (uses_pdl, added later) can be
// absent: modules exported by an earlier version still instantiate.
ffi::ErrorOr<std::unique_ptr<LaunchState>> Instantiate(ffi::Dictionary attrs) {
  using Result = ffi::ErrorOr<std::unique_ptr<LaunchState>>;
  auto name = attrs.get<std::string_view>("name");
  if (!name.has_value()) return Result(ffi::Unexpected(name.error()));
  auto bad = [&](const ffi::Error& e) {
    return Result(ffi::Unexpected(Err(ffi::ErrorCode::kInvalidArgument,
                                      "kernel " + std::string(*name) + ": malformed call: " +
                                          e.message())));
  };
  auto key = attrs.get<std::string_view>("key");
  if (!key.has_value()) return bad(key.error());
  auto symbol = attrs.get<std::string_view>("symbol");
  if (!symbol.has_value()) return bad(symbol.error());
  auto object = attrs.get<ffi::Span<const uint8_t>>("object");
  if (!object.has_value()) return bad(object.error());
  auto major = attrs.get<int64_t>("arch_major");
  if (!major.has_value()) return bad(major.error());
  auto minor = attrs.get<int64_t>("arch_minor");
  if (!minor.has_value()) return bad(minor.error());
  auto kinds = attrs.get<ffi::Span<const int64_t>>("arg_kinds");
  if (!kinds.has_value()) return bad(kinds.error());
  auto offsets = attrs.get<ffi::Span<const int64_t>>("arg_offsets");
  if (!offsets.has_value()) return bad(offsets.error());
  auto words = attrs.get<ffi::Span<const int64_t>>("arg_words");
  if (!words.has_value()) return bad(words.error());
  auto align = attrs.get<ffi::Span<const int64_t>>("arg_align");
  if (!align.has_value()) return bad(align.error());
  bool uses_pdl = false;
  if (attrs.contains("uses_pdl")) {
    auto flag = attrs.get<bool>("uses_pdl");
    if (!flag.has_value()) return bad(flag.error());
    uses_pdl = *flag;
  }
  return ParseState(*name, *key, *symbol, *object, *major, *minor, *kinds, *offsets, *words,
                    *align, uses_pdl);
}

// ------------------------------------------------------------------------------------------
// Stage 2: initialize (device and stream known; runs before execution, not in graph replays)
// ------------------------------------------------------------------------------------------

ffi::Error Initialize(cudaStream_t stream, int32_t device, LaunchState* state,
                      ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  if (state == nullptr) return Err(ffi::ErrorCode::kInternal, "initialize found no state");
  if (ffi::Error e = CheckBufferCount(*state, args.size() + rets.size()); e.failure()) return e;
  if (state->Cached(device) != nullptr) return ffi::Error::Success();
  auto object = attrs.get<ffi::Span<const uint8_t>>("object");
  if (!object.has_value()) return object.error();
  DslFunction* fn = nullptr;
  return ResolveFunction(*state, *object, device, stream, &fn);
}

// ------------------------------------------------------------------------------------------
// Stage 3: execute (hot path: may run from several threads at once on one state)
// ------------------------------------------------------------------------------------------

// The launcher's argument vector (see kernels/abi.py): one pointer per argument, then &ret.
// Buffers are taken from the call's operands and results, checked for the alignment the kernel
// assumes, and written into copies of the descriptor templates. Typical launchers fit the
// inline storage; larger ones use the heap.
class LauncherArgs {
 public:
  static constexpr size_t kInlineArgs = 32;
  static constexpr size_t kInlineWords = 256;

  ffi::Error Pack(const LaunchState& s, cudaStream_t stream, ffi::RemainingArgs& args,
                  ffi::RemainingRets& rets) {
    const size_t n = s.kinds.size();
    const size_t num_inputs = args.size();
    argv_ = inline_args_;
    storage_ = inline_words_;
    if (n + 1 > kInlineArgs + 1) {
      heap_args_.resize(n + 1);
      argv_ = heap_args_.data();
    }
    if (s.words.size() > kInlineWords) {
      heap_words_.resize(s.words.size());
      storage_ = heap_words_.data();
    }
    stream_ = stream;
    ret_ = 0;
    for (size_t i = 0; i < n; ++i) {
      const int64_t kind = s.kinds[i];
      const int64_t begin = s.offsets[i];
      if (kind == -1) {
        argv_[i] = &stream_;
      } else if (kind == -2) {
        // Scalars are read-only for the launcher: point straight at the template.
        argv_[i] = const_cast<int64_t*>(s.words.data() + begin);
      } else {
        void* data = nullptr;
        const size_t k = static_cast<size_t>(kind);
        if (k < num_inputs) {
          auto buffer = args.get<ffi::AnyBuffer>(k);
          if (!buffer.has_value()) return buffer.error();
          data = buffer->untyped_data();
        } else {
          auto buffer = rets.get<ffi::AnyBuffer>(k - num_inputs);
          if (!buffer.has_value()) return buffer.error();
          data = (*buffer)->untyped_data();
        }
        const int64_t alignment = s.align[i];
        if (alignment > 0 && reinterpret_cast<uintptr_t>(data) % static_cast<uint64_t>(alignment)) {
          return Err(ffi::ErrorCode::kInvalidArgument,
                     Format("kernel %s: argument %zu (buffer %zu) at %p is not aligned to %" PRId64
                            " bytes, as the kernel's alignment assumes",
                            s.name.c_str(), i, k, data, alignment));
        }
        int64_t* desc = storage_ + begin;
        std::memcpy(desc, s.words.data() + begin, (s.offsets[i + 1] - begin) * sizeof(int64_t));
        std::memcpy(desc, &data, sizeof(void*));  // word 0 is the data pointer
        argv_[i] = desc;
      }
    }
    argv_[n] = &ret_;
    count_ = n + 1;
    return ffi::Error::Success();
  }

  void** argv() { return argv_; }
  size_t count() const { return count_; }
  int32_t ret() const { return ret_; }

 private:
  void* inline_args_[kInlineArgs + 1];
  int64_t inline_words_[kInlineWords];
  std::vector<void*> heap_args_;
  std::vector<int64_t> heap_words_;
  void** argv_ = nullptr;
  int64_t* storage_ = nullptr;
  size_t count_ = 0;
  cudaStream_t stream_ = nullptr;
  int32_t ret_ = 0;
};

// The state's function for `device`, resolved (and its module loaded) on first use.
ffi::Error FunctionFor(LaunchState& state, int32_t device, cudaStream_t stream,
                       ffi::Dictionary& attrs, DslFunction** fn) {
  if ((*fn = state.Cached(device)) != nullptr) return ffi::Error::Success();
  // Initialize normally resolved the function already. XLA may skip that stage on some paths
  // (e.g. devices past our cache, or command buffers on some versions), so resolve it here
  // rather than fail; the registry still loads it only once per device.
  auto object = attrs.get<ffi::Span<const uint8_t>>("object");
  if (!object.has_value()) return object.error();
  return ResolveFunction(state, *object, device, stream, fn);
}

// Runs the launcher of `fn` with packed arguments on the stream they name (the context of
// `stream` made current: the launcher sets attributes on the current device).
ffi::Error RunLauncher(const LaunchState& s, DslFunction* fn, LauncherArgs& packed,
                       cudaStream_t stream) {
  const DslRuntime* rt = g_runtime.load(std::memory_order_acquire);  // set by ResolveFunction
  const Driver* d = g_driver.load(std::memory_order_acquire);
  ScopedStreamContext context;
  if (ffi::Error e = context.Enter(*d, stream); e.failure()) return e;
  int rc = 0;
  try {
    rc = rt->FunctionRun(fn, packed.argv(), packed.count());
  } catch (...) {
    return Err(ffi::ErrorCode::kInternal,
               "kernel " + s.name + ": the CuTe DSL runtime threw while launching");
  }
  if (rc != 0) {
    return Err(ffi::ErrorCode::kInternal,
               "kernel " + s.name + ": CuteDSLRT_Function_Run failed: " + rt->Describe(rc));
  }
  if (packed.ret() != 0) {
    return Err(ffi::ErrorCode::kInternal,
               "kernel " + s.name + ": launch failed with CUDA error " + d->Describe(packed.ret()));
  }
  return ffi::Error::Success();
}

ffi::Error Execute(cudaStream_t stream, int32_t device, LaunchState* state,
                   ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  if (state == nullptr) return Err(ffi::ErrorCode::kInternal, "execute found no state");
  if (ffi::Error e = CheckBufferCount(*state, args.size() + rets.size()); e.failure()) return e;
  DslFunction* fn = nullptr;
  if (ffi::Error e = FunctionFor(*state, device, stream, attrs, &fn); e.failure()) return e;
  LauncherArgs packed;
  if (ffi::Error e = packed.Pack(*state, stream, args, rets); e.failure()) return e;
  ffi::Error e = RunLauncher(*state, fn, packed, stream);
  if (e.success()) g_launches.fetch_add(1, std::memory_order_relaxed);
  return e;
}

#if JAX_CUTE_HAVE_RECORD
// ------------------------------------------------------------------------------------------
// Stage 4: record (XLA builds a command buffer and asks us for its commands)
// ------------------------------------------------------------------------------------------
//
// Without this stage XLA records our call by stream capture into a child graph, where a kernel
// cannot start under its predecessor's tail. Here we give XLA the kernel launch itself: we run
// the DSL's launcher once under capture on a private stream (so it builds its parameters, the
// TMA descriptors included, exactly as it would launch), read the one kernel node it captured,
// and hand XLA that kernel (the cubin from the object), its dimensions and its parameter bytes.
// XLA then adds a kernel node to its graph, with a programmatic edge when the kernel was built
// for programmatic dependent launch. A launcher that captures anything other than one kernel
// asks XLA for the stream-capture path instead.

using CUgraph = struct CUgraph_st*;
using CUgraphNode = struct CUgraphNode_st*;
using CUfunction = struct CUfunc_st*;
using CUkernel = struct CUkern_st*;

struct KernelNodeParams {  // CUDA_KERNEL_NODE_PARAMS_v2
  CUfunction func;
  unsigned grid[3];
  unsigned block[3];
  unsigned shared_bytes;
  void** params;
  void** extra;
  CUkernel kern;
  CUcontext ctx;
};

union LaunchAttrValue {  // CUlaunchAttributeValue
  char pad[64];
  struct {
    unsigned x, y, z;
  } cluster;
};

constexpr int kCaptureModeRelaxed = 2;       // CU_STREAM_CAPTURE_MODE_RELAXED
constexpr unsigned kStreamNonBlocking = 1;   // CU_STREAM_NON_BLOCKING
constexpr int kGraphNodeKernel = 0;          // CU_GRAPH_NODE_TYPE_KERNEL
constexpr int kLaunchAttrClusterDim = 4;     // CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
constexpr uintptr_t kParamBufferPointer = 1; // CU_LAUNCH_PARAM_BUFFER_POINTER
constexpr uintptr_t kParamBufferSize = 2;    // CU_LAUNCH_PARAM_BUFFER_SIZE

// Driver entry points for reading a captured launch (CUDA 12.4 or newer).
struct GraphDriver {
  CUresult (*StreamCreate)(cudaStream_t*, unsigned);
  CUresult (*StreamBeginCapture)(cudaStream_t, int);
  CUresult (*StreamEndCapture)(cudaStream_t, CUgraph*);
  CUresult (*GraphGetNodes)(CUgraph, CUgraphNode*, size_t*);
  CUresult (*GraphNodeGetType)(CUgraphNode, int*);
  CUresult (*KernelNodeGetParams)(CUgraphNode, KernelNodeParams*);
  CUresult (*KernelNodeGetAttribute)(CUgraphNode, int, LaunchAttrValue*);
  CUresult (*GraphDestroy)(CUgraph);
  CUresult (*FuncGetParamInfo)(CUfunction, size_t, size_t*, size_t*);
  CUresult (*FuncGetName)(const char**, CUfunction);
  CUresult (*KernelGetFunction)(CUfunction*, CUkernel);
};

std::atomic<const GraphDriver*> g_graph_driver{nullptr};
std::atomic<int64_t> g_recorded{0};
std::atomic<int64_t> g_record_fallbacks{0};
std::atomic<int64_t> g_record_skips{0};

ffi::Error GetGraphDriver(const GraphDriver** out) {
  if ((*out = g_graph_driver.load(std::memory_order_acquire)) != nullptr) {
    return ffi::Error::Success();
  }
  std::lock_guard<std::mutex> lock(g_load_mu);
  if ((*out = g_graph_driver.load(std::memory_order_relaxed)) != nullptr) {
    return ffi::Error::Success();
  }
  LibraryBinder lib("libcuda.so.1", RTLD_NOW | RTLD_LOCAL, "the CUDA driver libcuda.so.1");
  auto g = std::make_unique<GraphDriver>();
  lib.Bind("cuStreamCreate", &g->StreamCreate);
  lib.Bind("cuStreamBeginCapture_v2", &g->StreamBeginCapture);
  lib.Bind("cuStreamEndCapture", &g->StreamEndCapture);
  lib.Bind("cuGraphGetNodes", &g->GraphGetNodes);
  lib.Bind("cuGraphNodeGetType", &g->GraphNodeGetType);
  lib.Bind("cuGraphKernelNodeGetParams_v2", &g->KernelNodeGetParams);
  lib.Bind("cuGraphKernelNodeGetAttribute", &g->KernelNodeGetAttribute);
  lib.Bind("cuGraphDestroy", &g->GraphDestroy);
  lib.Bind("cuFuncGetParamInfo", &g->FuncGetParamInfo);
  lib.Bind("cuFuncGetName", &g->FuncGetName);
  lib.Bind("cuKernelGetFunction", &g->KernelGetFunction);
  if (ffi::Error e = lib.Status(); e.failure()) return e;
  *out = g.release();
  g_graph_driver.store(*out, std::memory_order_release);
  return ffi::Error::Success();
}

// One launch read back from a capture: what XLA needs to record it as a kernel node.
struct CapturedLaunch {
  bool single_kernel = false;  // false: the launcher did something else (or more)
  std::string kernel_name;
  unsigned grid[3] = {1, 1, 1};
  unsigned block[3] = {1, 1, 1};
  unsigned cluster[3] = {0, 0, 0};
  unsigned shared_bytes = 0;
  std::vector<std::vector<uint8_t>> params;  // each parameter's bytes, in order
};

// Capturing is rare (once per graph recording) and serialised: one private stream per context.
std::mutex g_capture_mu;
std::map<CUcontext, cudaStream_t>* g_capture_streams = new std::map<CUcontext, cudaStream_t>();

// Reads the parameters of `func` out of a captured node: through the kernelParams array, or the
// packed buffer of `extra` when the launcher passed them that way.
ffi::Error ReadParams(const GraphDriver& g, const Driver& d, CUfunction func,
                      const KernelNodeParams& p, CapturedLaunch* out) {
  const uint8_t* buffer = nullptr;
  size_t buffer_size = 0;
  if (p.params == nullptr && p.extra != nullptr) {
    for (void** e = p.extra; *e != nullptr; e += 2) {
      const auto tag = reinterpret_cast<uintptr_t>(e[0]);
      if (tag == kParamBufferPointer) buffer = static_cast<const uint8_t*>(e[1]);
      if (tag == kParamBufferSize) buffer_size = *static_cast<const size_t*>(e[1]);
    }
  }
  for (size_t i = 0;; ++i) {
    size_t offset = 0, size = 0;
    if (g.FuncGetParamInfo(func, i, &offset, &size) != 0) break;  // past the last parameter
    const uint8_t* src = nullptr;
    if (p.params != nullptr) {
      src = static_cast<const uint8_t*>(p.params[i]);
    } else if (buffer != nullptr && offset + size <= buffer_size) {
      src = buffer + offset;
    }
    if (src == nullptr || size == 0) {
      return Err(ffi::ErrorCode::kInternal,
                 Format("captured launch: cannot read kernel parameter %zu", i));
    }
    out->params.emplace_back(src, src + size);
  }
  return ffi::Error::Success();
}

// Runs the launcher under capture on this context's private stream and reads back its launch.
ffi::Error CaptureLaunch(const LaunchState& s, DslFunction* fn, cudaStream_t xla_stream,
                         ffi::RemainingArgs& args, ffi::RemainingRets& rets,
                         CapturedLaunch* out) {
  const GraphDriver* g = nullptr;
  if (ffi::Error e = GetGraphDriver(&g); e.failure()) return e;
  const Driver* d = g_driver.load(std::memory_order_acquire);
  ScopedStreamContext context;
  if (ffi::Error e = context.Enter(*d, xla_stream); e.failure()) return e;
  CUcontext ctx = nullptr;
  if (CUresult r = d->StreamGetCtx(xla_stream, &ctx); r != 0) {
    return Err(ffi::ErrorCode::kInternal, "cuStreamGetCtx failed: " + d->Describe(r));
  }

  std::lock_guard<std::mutex> lock(g_capture_mu);
  cudaStream_t& cs = (*g_capture_streams)[ctx];
  if (cs == nullptr) {
    if (CUresult r = g->StreamCreate(&cs, kStreamNonBlocking); r != 0) {
      cs = nullptr;
      return Err(ffi::ErrorCode::kInternal, "cuStreamCreate failed: " + d->Describe(r));
    }
  }
  LauncherArgs packed;
  if (ffi::Error e = packed.Pack(s, cs, args, rets); e.failure()) return e;
  if (CUresult r = g->StreamBeginCapture(cs, kCaptureModeRelaxed); r != 0) {
    return Err(ffi::ErrorCode::kInternal, "cuStreamBeginCapture failed: " + d->Describe(r));
  }
  ffi::Error launched = RunLauncher(s, fn, packed, cs);
  CUgraph graph = nullptr;
  CUresult ended = g->StreamEndCapture(cs, &graph);
  // The graph is ours to destroy whatever happens below.
  std::unique_ptr<CUgraph_st, CUresult (*)(CUgraph)> owned(graph, g->GraphDestroy);
  if (launched.failure()) return launched;
  if (ended != 0 || graph == nullptr) {
    return Err(ffi::ErrorCode::kInternal, "cuStreamEndCapture failed: " + d->Describe(ended));
  }

  size_t count = 0;
  if (CUresult r = g->GraphGetNodes(graph, nullptr, &count); r != 0) {
    return Err(ffi::ErrorCode::kInternal, "cuGraphGetNodes failed: " + d->Describe(r));
  }
  if (count != 1) return ffi::Error::Success();  // not a single launch: out->single_kernel false
  CUgraphNode node = nullptr;
  int type = -1;
  if (g->GraphGetNodes(graph, &node, &count) != 0 || g->GraphNodeGetType(node, &type) != 0 ||
      type != kGraphNodeKernel) {
    return ffi::Error::Success();
  }
  KernelNodeParams p{};
  if (CUresult r = g->KernelNodeGetParams(node, &p); r != 0) {
    return Err(ffi::ErrorCode::kInternal, "cuGraphKernelNodeGetParams failed: " + d->Describe(r));
  }
  CUfunction func = p.func;
  if (func == nullptr && p.kern != nullptr) {
    if (CUresult r = g->KernelGetFunction(&func, p.kern); r != 0) {
      return Err(ffi::ErrorCode::kInternal, "cuKernelGetFunction failed: " + d->Describe(r));
    }
  }
  const char* name = nullptr;
  if (func == nullptr || g->FuncGetName(&name, func) != 0 || name == nullptr) {
    return Err(ffi::ErrorCode::kInternal, "captured launch: cannot name its kernel");
  }
  out->kernel_name = name;
  for (int i = 0; i < 3; ++i) {
    out->grid[i] = p.grid[i];
    out->block[i] = p.block[i];
  }
  out->shared_bytes = p.shared_bytes;
  LaunchAttrValue cluster{};
  if (g->KernelNodeGetAttribute(node, kLaunchAttrClusterDim, &cluster) == 0) {
    out->cluster[0] = cluster.cluster.x;
    out->cluster[1] = cluster.cluster.y;
    out->cluster[2] = cluster.cluster.z;
  }
  if (ffi::Error e = ReadParams(*g, *d, func, p, out); e.failure()) return e;
  out->single_kernel = true;
  return ffi::Error::Success();
}

// Size of the ELF image starting at `elf` (at most `avail` bytes): the end of its section
// header table or of its last section, whichever is further. 0 when it is not a sane ELF64.
size_t ElfImageSize(const uint8_t* elf, size_t avail) {
  if (avail < 64) return 0;
  uint64_t shoff = 0;
  uint16_t shentsize = 0, shnum = 0;
  std::memcpy(&shoff, elf + 0x28, 8);
  std::memcpy(&shentsize, elf + 0x3a, 2);
  std::memcpy(&shnum, elf + 0x3c, 2);
  if (shentsize < 64 || shoff > avail || size_t{shnum} * shentsize > avail - shoff) return 0;
  size_t end = shoff + size_t{shnum} * shentsize;
  for (uint16_t i = 0; i < shnum; ++i) {
    uint32_t type = 0;
    uint64_t off = 0, len = 0;
    const uint8_t* sh = elf + shoff + size_t{i} * shentsize;
    std::memcpy(&type, sh + 4, 4);
    std::memcpy(&off, sh + 24, 8);
    std::memcpy(&len, sh + 32, 8);
    if (type == 8 /*SHT_NOBITS*/) continue;
    if (off > avail || len > avail - off) return 0;
    end = std::max<size_t>(end, off + len);
  }
  return end;
}

// The cubin inside a DSL object that defines `kernel`: the object embeds the device ELF as data.
// Kept for the life of the process (XLA caches the module it loads by this address).
std::mutex g_cubin_mu;
std::map<std::pair<std::string, std::string>, std::string>* g_cubins =
    new std::map<std::pair<std::string, std::string>, std::string>();

ffi::Error CubinFor(const LaunchState& s, ffi::Span<const uint8_t> object,
                    const std::string& kernel, const std::string** out) {
  std::lock_guard<std::mutex> lock(g_cubin_mu);
  const auto key = std::make_pair(s.key, kernel);
  if (auto it = g_cubins->find(key); it != g_cubins->end()) {
    *out = &it->second;
    return ffi::Error::Success();
  }
  const uint8_t* obj = object.begin();
  const size_t size = object.size();
  const uint8_t kMagic[4] = {0x7f, 'E', 'L', 'F'};
  for (size_t at = 1; at + 64 <= size; ++at) {
    if (std::memcmp(obj + at, kMagic, 4) != 0 || obj[at + 4] != 2 /*64-bit*/) continue;
    uint16_t machine = 0;
    std::memcpy(&machine, obj + at + 0x12, 2);
    if (machine != 190 /*EM_CUDA*/) continue;
    const size_t image = ElfImageSize(obj + at, size - at);
    if (image == 0 || !ElfDefinesSymbol(obj + at, image, kernel)) continue;
    auto [it, _] = g_cubins->emplace(key, std::string(reinterpret_cast<const char*>(obj + at), image));
    *out = &it->second;
    return ffi::Error::Success();
  }
  return Err(ffi::ErrorCode::kInternal,
             "kernel " + s.name + ": its object holds no cubin defining " + kernel);
}

// The record extension as XLA hands it over (C API; XLA's C++ wrapper is internal to it).
struct RecordExtension {
  struct Type {
    const XLA_FFI_Api* api;
    const XLA_FFI_RecordFrame* frame;
  };
  using CExtension = XLA_FFI_Record_Extension;
  static constexpr auto kName = "RecordExtension";
  static constexpr int32_t kExtensionType = XLA_FFI_Extension_Record;
  static constexpr int32_t kMajorVersion = XLA_FFI_Extension_Record_MajorVersion;
  static constexpr int32_t kMinorVersion = XLA_FFI_Extension_Record_MinorVersion;
  // create_launch with uses_pdl (what we call) exists from minor version 1 on.
  static bool Support(int32_t major, int32_t minor) { return major == 0 && minor >= 1; }
  static Type Create(const XLA_FFI_Api* api, const CExtension* ext) {
    return Type{api, ext->record_frame};
  }
};

ffi::Error FromXla(const XLA_FFI_Api* api, XLA_FFI_Error* error, const char* what) {
  if (error == nullptr) return ffi::Error::Success();
  std::string message = ffi::internal::GetErrorMessage(api, error);
  ffi::internal::DestroyError(api, error);
  return Err(ffi::ErrorCode::kInternal, std::string(what) + " failed: " + message);
}

ffi::Error Record(cudaStream_t stream, int32_t device, LaunchState* state,
                  RecordExtension::Type record, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  ffi::Dictionary attrs) {
  if (state == nullptr) return Err(ffi::ErrorCode::kInternal, "record found no state");
  const XLA_FFI_RecordFrame& frame = *record.frame;
  const XLA_FFI_RecordApi& api = *frame.api;
  if (ffi::Error e = CheckBufferCount(*state, args.size() + rets.size()); e.failure()) return e;
  DslFunction* fn = nullptr;
  if (ffi::Error e = FunctionFor(*state, device, stream, attrs, &fn); e.failure()) return e;
  // XLA 0.11 asks for an update on nearly every run. The kernel's parameters depend only on the
  // buffer addresses, so an update with the addresses the command already holds is skipped:
  // no capture here, and no parameter change (re-upload) in XLA's executable graph.
  std::vector<void*> addresses;
  addresses.reserve(args.size() + rets.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    addresses.push_back(b.has_value() ? b->untyped_data() : nullptr);
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    addresses.push_back(b.has_value() ? (*b)->untyped_data() : nullptr);
  }
  const bool update = frame.action == XLA_FFI_RecordAction_Update;
  if (update && frame.commands != nullptr && *frame.num_commands == 1 &&
      state->RecordedWith(frame.commands[0], addresses)) {
    g_record_skips.fetch_add(1, std::memory_order_relaxed);
    return ffi::Error::Success();
  }
  CapturedLaunch launch;
  if (ffi::Error e = CaptureLaunch(*state, fn, stream, args, rets, &launch); e.failure()) return e;
  if (!launch.single_kernel) {
    g_record_fallbacks.fetch_add(1, std::memory_order_relaxed);
    return FromXla(record.api, api.request_stream_capture(frame.record_ctx),
                   "request_stream_capture");
  }

  std::vector<XLA_FFI_KernelArg> kernel_args;
  kernel_args.reserve(launch.params.size());
  for (const auto& p : launch.params) {
    kernel_args.push_back({p.data(), static_cast<int64_t>(p.size()), XLA_FFI_KernelArgType_HostValue});
  }
  const XLA_FFI_KernelArgs packed{kernel_args.data(), static_cast<int64_t>(kernel_args.size())};

  if (update) {
    // Buffer addresses changed: same kernel and dimensions, new parameters.
    if (frame.commands == nullptr || *frame.num_commands != 1) {
      return Err(ffi::ErrorCode::kInternal, "kernel " + state->name +
                                                ": update without the one command we recorded");
    }
    ffi::Error e = FromXla(record.api, api.update_launch(frame.record_ctx, frame.commands[0], &packed),
                           "update_launch");
    if (e.success()) {
      state->Remember(frame.commands[0], std::move(addresses));
      g_recorded.fetch_add(1, std::memory_order_relaxed);
    }
    return e;
  }

  auto object = attrs.get<ffi::Span<const uint8_t>>("object");
  if (!object.has_value()) return object.error();
  const std::string* cubin = nullptr;
  if (ffi::Error e = CubinFor(*state, *object, launch.kernel_name, &cubin); e.failure()) return e;
  if (frame.commands == nullptr || *frame.num_commands >= frame.max_commands) {
    return Err(ffi::ErrorCode::kInternal, "kernel " + state->name + ": no room to record a command");
  }
  XLA_FFI_LaunchDims dims{};
  dims.grid = {static_cast<int32_t>(launch.grid[0]), static_cast<int32_t>(launch.grid[1]),
               static_cast<int32_t>(launch.grid[2])};
  dims.block = {static_cast<int32_t>(launch.block[0]), static_cast<int32_t>(launch.block[1]),
                static_cast<int32_t>(launch.block[2])};
  dims.cluster = {static_cast<int32_t>(launch.cluster[0]), static_cast<int32_t>(launch.cluster[1]),
                  static_cast<int32_t>(launch.cluster[2])};
  const XLA_FFI_Command* command = nullptr;
  ffi::Error e = FromXla(
      record.api,
      api.create_launch(frame.record_ctx, launch.kernel_name.c_str(), cubin->data(),
                        static_cast<int64_t>(cubin->size()), XLA_FFI_SourceFormat_CUBIN, dims,
                        launch.shared_bytes, state->uses_pdl ? 1 : 0, &packed, nullptr, 0, &command),
      "create_launch");
  if (e.failure()) return e;
  frame.commands[(*frame.num_commands)++] = command;
  state->Remember(command, std::move(addresses));
  g_recorded.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}
#endif  // JAX_CUTE_HAVE_RECORD

}  // namespace
}  // namespace jax_cute

#if JAX_CUTE_HAVE_RECORD
// The XLA FFI API table itself, as a handler context: the only way to reach XLA_FFI_Handler_Register,
// whose bundle (unlike the registration jaxlib 0.11 offers Python) carries a record stage.
namespace jax_cute {
struct FfiApiTag {};
}  // namespace jax_cute

template <>
struct xla::ffi::CtxDecoding<jax_cute::FfiApiTag> {
  using Type = const XLA_FFI_Api*;
  static std::optional<Type> Decode(const XLA_FFI_Api* api, XLA_FFI_InvokeContext*,
                                    DiagnosticEngine&) {
    return api;
  }
};

namespace jax_cute {
namespace {
std::atomic<const XLA_FFI_Api*> g_ffi_api{nullptr};

// Handler of the probe call: compiling it on a GPU backend instantiates it, which hands us the API.
ffi::Error RememberApi(const XLA_FFI_Api* api) {
  g_ffi_api.store(api, std::memory_order_release);
  return ffi::Error::Success();
}
}  // namespace
}  // namespace jax_cute

namespace jax_cute {
XLA_FFI_DEFINE_HANDLER(kProbeInstantiate, RememberApi, ffi::Ffi::BindInstantiate().Ctx<FfiApiTag>());
XLA_FFI_DEFINE_HANDLER(kProbeExecute, RememberApi, ffi::Ffi::Bind().Ctx<FfiApiTag>());
}  // namespace jax_cute
#endif  // JAX_CUTE_HAVE_RECORD

namespace jax_cute {

// Bindings of the three stages, shared by the two handler sets below.
auto InstantiateBinding() { return ffi::Ffi::BindInstantiate().Attrs(); }

// What Initialize and Execute both take: stream, device, state, buffers and attributes.
template <typename Binder>
auto WithLaunchContext(Binder binder) {
  return std::move(binder)
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Ctx<ffi::State<LaunchState>>()
      .RemainingArgs()
      .RemainingRets()
      .Attrs();
}

auto InitializeBinding() { return WithLaunchContext(ffi::Ffi::BindInitialize()); }
auto ExecuteBinding() { return WithLaunchContext(ffi::Ffi::Bind()); }

// Graph handlers: XLA may record the launch into its command buffers (CUDA graphs). With the
// record stage (jaxlib 0.11+) we hand it our kernel node (see Record); otherwise it records the
// call by stream capture. Either way it records again whenever a buffer address changed since
// the last recording. The trait is declared on every stage: XLA reads handler metadata and the trait
// must be visible whichever handler it asks.
XLA_FFI_DEFINE_HANDLER(kInstantiate, Instantiate, InstantiateBinding(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kInitialize, Initialize, InitializeBinding(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kExecute, Execute, ExecuteBinding(), {ffi::Traits::kCmdBufferCompatible});
#if JAX_CUTE_HAVE_RECORD
XLA_FFI_DEFINE_HANDLER(kRecord, Record,
                       ffi::Ffi::BindRecord()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Ctx<ffi::State<LaunchState>>()
                           .Ctx<ffi::Extension<RecordExtension>>()
                           .RemainingArgs()
                           .RemainingRets()
                           .Attrs(),
                       {ffi::Traits::kCmdBufferCompatible});
#endif

// Stream handlers: the same stages without the trait. XLA launches them on its stream on every
// run, outside command buffers, so a kernel launched with programmatic dependent launch can
// overlap the kernel before it (a graph records our call as a child graph, where it cannot).
XLA_FFI_DEFINE_HANDLER(kInstantiateStream, Instantiate, InstantiateBinding());
XLA_FFI_DEFINE_HANDLER(kInitializeStream, Initialize, InitializeBinding());
XLA_FFI_DEFINE_HANDLER(kExecuteStream, Execute, ExecuteBinding());

// ------------------------------------------------------------------------------------------
// Python module
// ------------------------------------------------------------------------------------------

namespace {

void SetRuntimeLibrary(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_load_mu);
  if (g_runtime.load(std::memory_order_relaxed) != nullptr && path != g_runtime_path) {
    throw std::runtime_error("jax_cute: the CuTe DSL runtime is already loaded from " +
                             g_runtime_path + "; cannot switch to " + path);
  }
  g_runtime_path = path;
}

std::string RuntimeLibrary() {
  std::lock_guard<std::mutex> lock(g_load_mu);
  return g_runtime_path;
}

void LoadRuntimeLibrary() {
  const DslRuntime* rt = nullptr;
  ffi::Error e = GetRuntime(&rt);
  if (e.failure()) throw std::runtime_error(e.message());
}

nb::dict Registrations(bool command_buffer) {
  nb::dict d;
  d["instantiate"] =
      nb::capsule(reinterpret_cast<void*>(command_buffer ? kInstantiate : kInstantiateStream));
  d["initialize"] =
      nb::capsule(reinterpret_cast<void*>(command_buffer ? kInitialize : kInitializeStream));
  d["execute"] = nb::capsule(reinterpret_cast<void*>(command_buffer ? kExecute : kExecuteStream));
  return d;
}

#if JAX_CUTE_HAVE_RECORD
nb::dict ProbeRegistrations() {
  nb::dict d;
  d["instantiate"] = nb::capsule(reinterpret_cast<void*>(kProbeInstantiate));
  d["execute"] = nb::capsule(reinterpret_cast<void*>(kProbeExecute));
  return d;
}

// Registers the graph handlers, record stage included, under `name` through XLA's own FFI API
// (found by the probe). Raises when the probe has not run or XLA refuses.
void RegisterRecordingTarget(const std::string& name, const std::string& platform) {
  const XLA_FFI_Api* api = g_ffi_api.load(std::memory_order_acquire);
  if (api == nullptr) throw std::runtime_error("jax_cute: the XLA FFI API was not found (probe not run)");
  XLA_FFI_Handler_Register_Args args{};
  args.struct_size = XLA_FFI_Handler_Register_Args_STRUCT_SIZE;
  args.name = XLA_FFI_ByteSpan{name.data(), name.size()};
  args.platform = XLA_FFI_ByteSpan{platform.data(), platform.size()};
  args.bundle.instantiate = kInstantiate;
  args.bundle.initialize = kInitialize;
  args.bundle.execute = kExecute;
  args.bundle.record = kRecord;
  args.traits = XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE;
  if (XLA_FFI_Error* error = api->XLA_FFI_Handler_Register(&args); error != nullptr) {
    std::string message = ffi::internal::GetErrorMessage(api, error);
    ffi::internal::DestroyError(api, error);
    throw std::runtime_error("jax_cute: registering " + name + " failed: " + message);
  }
}
#endif

nb::dict StateType() {
  static auto type_info = ffi::MakeTypeInfo<LaunchState>();
  nb::dict d;
  d["type_id"] = nb::capsule(reinterpret_cast<void*>(&LaunchState::id));
  d["type_info"] = nb::capsule(reinterpret_cast<void*>(&type_info));
  return d;
}

nb::dict Stats() {
  nb::dict d;
  d["modules_created"] = g_modules_created.load();
  d["functions_loaded"] = g_functions_loaded.load();
  d["launches"] = g_launches.load();
#if JAX_CUTE_HAVE_RECORD
  d["recorded"] = g_recorded.load();
  d["record_fallbacks"] = g_record_fallbacks.load();
  d["record_skips"] = g_record_skips.load();
#else
  d["recorded"] = 0;
  d["record_fallbacks"] = 0;
  d["record_skips"] = 0;
#endif
  return d;
}

bool PyObjectHasFunction(nb::bytes object, const std::string& symbol) {
  return ObjectHasFunction(reinterpret_cast<const uint8_t*>(object.c_str()), object.size(),
                           symbol);
}

}  // namespace
}  // namespace jax_cute

NB_MODULE(_ffi, m) {
  m.doc() = "jax_cute's XLA FFI handler for CuTe DSL launchers (target 'jax_cute_launch').";
  m.def("set_runtime_library", &jax_cute::SetRuntimeLibrary, nb::arg("path"),
        "Remember the path of libcute_dsl_runtime.so; it is dlopened on first use.");
  m.def("runtime_library", &jax_cute::RuntimeLibrary, "The path set by set_runtime_library.");
  m.def("load_runtime_library", &jax_cute::LoadRuntimeLibrary,
        "Load the DSL runtime now; raises RuntimeError on failure.");
  m.def("registrations", &jax_cute::Registrations, nb::arg("command_buffer") = true,
        "Stage name -> handler capsule, for jax.ffi.register_ffi_target(api_version=1); "
        "command_buffer=False gives the stream handlers (never recorded into a CUDA graph).");
  m.def("state_type", &jax_cute::StateType,
        "Type registration of the handler's state, for jax.ffi.register_ffi_type.");
  m.def("stats", &jax_cute::Stats,
        "Counters: modules_created, functions_loaded, launches (run by us on a stream), "
        "recorded (kernel launches handed to XLA's command buffers, updates included) and "
        "record_fallbacks (recordings left to stream capture).");
#if JAX_CUTE_HAVE_RECORD
  m.def("probe_registrations", &jax_cute::ProbeRegistrations,
        "Handlers of the probe target: compiling a call to it on a GPU backend hands this module "
        "XLA's FFI API (see register_recording_target).");
  m.def("ffi_api_found", []() { return jax_cute::g_ffi_api.load() != nullptr; },
        "Whether the probe has handed over XLA's FFI API.");
  m.def("register_recording_target", &jax_cute::RegisterRecordingTarget, nb::arg("name"),
        nb::arg("platform") = "CUDA",
        "Register the graph handlers with their record stage under `name` (after the probe).");
#endif
  m.def("has_record_stage", []() { return JAX_CUTE_HAVE_RECORD != 0; },
        "Whether this build has the FFI record stage (jaxlib 0.11+ headers): registered with "
        "register_recording_target, it hands XLA's command buffers its kernel nodes itself.");
  m.def("object_has_function", &jax_cute::PyObjectHasFunction, nb::arg("object"),
        nb::arg("symbol"),
        "Whether an object from dump_to_object defines the launcher with this prefix.");
}
