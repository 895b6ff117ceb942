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

ffi::ErrorOr<std::unique_ptr<LaunchState>> Instantiate(
    std::string_view name, std::string_view key, std::string_view symbol,
    ffi::Span<const uint8_t> object, int64_t arch_major, int64_t arch_minor,
    ffi::Span<const int64_t> kinds, ffi::Span<const int64_t> offsets,
    ffi::Span<const int64_t> words, ffi::Span<const int64_t> align) {
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
  return ffi::ErrorOr<std::unique_ptr<LaunchState>>(std::move(state));
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

// Argument storage on the stack for typical launchers; larger ones fall back to the heap.
constexpr size_t kInlineArgs = 32;
constexpr size_t kInlineWords = 256;

ffi::Error Execute(cudaStream_t stream, int32_t device, LaunchState* state,
                   ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  if (state == nullptr) return Err(ffi::ErrorCode::kInternal, "execute found no state");
  const LaunchState& s = *state;
  const size_t num_inputs = args.size();
  if (ffi::Error e = CheckBufferCount(s, num_inputs + rets.size()); e.failure()) return e;

  DslFunction* fn = s.Cached(device);
  if (fn == nullptr) {
    // Initialize normally resolved the function already. XLA may skip that stage on some
    // paths (e.g. devices past our cache, or command buffers on some versions), so resolve
    // it here rather than fail; the registry still loads it only once per device.
    auto object = attrs.get<ffi::Span<const uint8_t>>("object");
    if (!object.has_value()) return object.error();
    if (ffi::Error e = ResolveFunction(*state, *object, device, stream, &fn); e.failure()) {
      return e;
    }
  }
  const DslRuntime* rt = g_runtime.load(std::memory_order_acquire);  // set by ResolveFunction
  const Driver* d = g_driver.load(std::memory_order_acquire);

  const size_t n = s.kinds.size();
  void* inline_args[kInlineArgs + 1];
  int64_t inline_words[kInlineWords];
  std::vector<void*> heap_args;
  std::vector<int64_t> heap_words;
  void** argv = inline_args;
  int64_t* storage = inline_words;
  if (n + 1 > kInlineArgs + 1) {
    heap_args.resize(n + 1);
    argv = heap_args.data();
  }
  if (s.words.size() > kInlineWords) {
    heap_words.resize(s.words.size());
    storage = heap_words.data();
  }

  cudaStream_t stream_arg = stream;
  int32_t ret = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t kind = s.kinds[i];
    const int64_t begin = s.offsets[i];
    if (kind == -1) {
      argv[i] = &stream_arg;
    } else if (kind == -2) {
      // Scalars are read-only for the launcher: point straight at the template.
      argv[i] = const_cast<int64_t*>(s.words.data() + begin);
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
      int64_t* desc = storage + begin;
      std::memcpy(desc, s.words.data() + begin, (s.offsets[i + 1] - begin) * sizeof(int64_t));
      std::memcpy(desc, &data, sizeof(void*));  // word 0 is the data pointer
      argv[i] = desc;
    }
  }
  argv[n] = &ret;

  // The launcher sets attributes on the current device: make sure it is the stream's.
  ScopedStreamContext context;
  if (ffi::Error e = context.Enter(*d, stream); e.failure()) return e;
  int rc = 0;
  try {
    rc = rt->FunctionRun(fn, argv, n + 1);
  } catch (...) {
    return Err(ffi::ErrorCode::kInternal,
               "kernel " + s.name + ": the CuTe DSL runtime threw while launching");
  }
  g_launches.fetch_add(1, std::memory_order_relaxed);
  if (rc != 0) {
    return Err(ffi::ErrorCode::kInternal,
               "kernel " + s.name + ": CuteDSLRT_Function_Run failed: " + rt->Describe(rc));
  }
  if (ret != 0) {
    return Err(ffi::ErrorCode::kInternal,
               "kernel " + s.name + ": launch failed with CUDA error " + d->Describe(ret));
  }
  return ffi::Error::Success();
}

}  // namespace

// Bindings of the three stages, shared by the two handler sets below.
auto InstantiateBinding() {
  return ffi::Ffi::BindInstantiate()
      .Attr<std::string_view>("name")
      .Attr<std::string_view>("key")
      .Attr<std::string_view>("symbol")
      .Attr<ffi::Span<const uint8_t>>("object")
      .Attr<int64_t>("arch_major")
      .Attr<int64_t>("arch_minor")
      .Attr<ffi::Span<const int64_t>>("arg_kinds")
      .Attr<ffi::Span<const int64_t>>("arg_offsets")
      .Attr<ffi::Span<const int64_t>>("arg_words")
      .Attr<ffi::Span<const int64_t>>("arg_align");
}

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

// Graph handlers: XLA may record the launch into its command buffers (CUDA graphs). It records
// an FFI call by stream capture, again whenever a buffer address changed since the last
// recording. The trait is declared on every stage: XLA reads handler metadata and the trait
// must be visible whichever handler it asks.
XLA_FFI_DEFINE_HANDLER(kInstantiate, Instantiate, InstantiateBinding(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kInitialize, Initialize, InitializeBinding(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kExecute, Execute, ExecuteBinding(), {ffi::Traits::kCmdBufferCompatible});

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
  m.def("stats", &jax_cute::Stats, "Counters: modules_created, functions_loaded, launches.");
  m.def("object_has_function", &jax_cute::PyObjectHasFunction, nb::arg("object"),
        nb::arg("symbol"),
        "Whether an object from dump_to_object defines the launcher with this prefix.");
}
