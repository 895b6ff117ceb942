// XLA FFI handler "jax_cute_launch": runs a launcher compiled by the CuTe DSL, an ELF object in
// the call's attributes, through NVIDIA's libcute_dsl_runtime.so, which we never ship or link but
// dlopen from the path Python gives; the CUDA driver is dlopened too. Stages: instantiate checks
// the attributes into a LaunchState; initialize loads the kernel for the device (host work that
// CUDA graph replays skip); execute checks every buffer against its argument's descriptor, fills
// the descriptors (kernels/abi.py, PackedArgs) and runs.

#include <dlfcn.h>
#include <elf.h>

#include <array>
#include <atomic>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/stl/map.h"
#include "nanobind/stl/string.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;
using Code = ffi::ErrorCode;

// CUDA's handles, declared here so no CUDA header is needed.
using cudaStream_t = struct CUstream_st*;
using CUcontext = struct CUctx_st*;
using CUresult = int;

namespace jax_cute {
namespace {

__attribute__((format(printf, 1, 2))) std::string Format(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return buf;
}
ffi::Error Err(Code code, const std::string& why) { return ffi::Error(code, "jax_cute: " + why); }

// Opens `path` and binds the entry points `bind_all` names into a new `Api` kept for the life of
// the process. Returns "" on success, else an error naming the library and every missing symbol.
template <typename Api, typename BindAll>
std::string Load(const std::string& path, int flags, const Api** out, BindAll bind_all) {
  void* lib = dlopen(path.c_str(), flags);
  const char* why = lib == nullptr ? dlerror() : nullptr;
  if (lib == nullptr) return "cannot load " + path + ": " + (why ? why : "unknown error");
  auto api = std::make_unique<Api>();
  std::string missing;
  bind_all(*api, [&](const char* name, auto** fn) {
    *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(lib, name));
    if (*fn == nullptr) missing += (missing.empty() ? "" : ", ") + std::string(name);
  });
  if (missing.empty()) *out = api.release();
  else dlclose(lib);
  return missing.empty() ? "" : path + " lacks " + missing;
}

// Entry points of the driver; XLA has initialised CUDA before any handler runs on its streams.
struct Driver {
  CUresult (*DeviceGetAttribute)(int*, int, int);
  CUresult (*StreamGetCtx)(cudaStream_t, CUcontext*);
  CUresult (*CtxGetCurrent)(CUcontext*);
  CUresult (*CtxGetDevice)(int*);
  CUresult (*CtxPushCurrent)(CUcontext);
  CUresult (*CtxPopCurrent)(CUcontext*);
  CUresult (*GetErrorName)(CUresult, const char**);
  std::string Describe(CUresult r) const {
    const char* name = nullptr;
    return Format("%s (%d)", GetErrorName(r, &name) == 0 && name ? name : "CUDA error", r);
  }
};

// The runtime's C API (CuteDSLRuntime.h) with opaque handles; 0 is success.
struct DslModule;
struct DslFunction;
struct DslRuntime {
  int (*ModuleCreateFromBytes)(DslModule**, const unsigned char*, size_t, const char**, size_t);
  int (*ModuleGetFunction)(DslFunction**, DslModule*, const char*);
  int (*FunctionRun)(DslFunction*, void**, size_t);
  int (*ModuleDestroy)(DslModule*);
  const char* (*GetErrorName)(int);
  const char* (*GetErrorString)(int);
  std::string Describe(int r) const {
    const char *name = GetErrorName(r), *text = GetErrorString(r);
    return Format("%s (%d): %s", name ? name : "error", r, text ? text : "");
  }
};

// g_mu guards loading both libraries and loading kernels. Execute reads g_driver and g_runtime
// without it, after an acquire load of a kernel's function, published once both were set.
std::mutex g_mu;
const Driver* g_driver = nullptr;
const DslRuntime* g_runtime = nullptr;
std::string g_runtime_path;

std::string LoadDriverLocked() {
  if (g_driver != nullptr) return "";
  return Load("libcuda.so.1", RTLD_NOW | RTLD_LOCAL, &g_driver, [](auto& d, auto bind) {
    bind("cuDeviceGetAttribute", &d.DeviceGetAttribute);
    bind("cuStreamGetCtx", &d.StreamGetCtx);
    bind("cuCtxGetCurrent", &d.CtxGetCurrent);
    bind("cuCtxGetDevice", &d.CtxGetDevice);
    bind("cuCtxPushCurrent_v2", &d.CtxPushCurrent);  // what cuda.h maps the plain names to
    bind("cuCtxPopCurrent_v2", &d.CtxPopCurrent);
    bind("cuGetErrorName", &d.GetErrorName);
  });
}

void SetRuntimeLibrary(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_runtime != nullptr) {
    if (path == g_runtime_path) return;
    throw std::runtime_error("jax_cute: the CuTe DSL runtime is already loaded from " +
                             g_runtime_path + "; cannot switch to " + path);
  }
  // RTLD_GLOBAL: the objects the runtime JIT-links resolve their helpers against it.
  std::string error = Load(path, RTLD_NOW | RTLD_GLOBAL, &g_runtime, [](auto& rt, auto bind) {
    bind("CuteDSLRT_Module_Create_From_Bytes", &rt.ModuleCreateFromBytes);
    bind("CuteDSLRT_Module_Get_Function", &rt.ModuleGetFunction);
    bind("CuteDSLRT_Function_Run", &rt.FunctionRun);
    bind("CuteDSLRT_Module_Destroy", &rt.ModuleDestroy);
    bind("CuteDSLRT_GetErrorName", &rt.GetErrorName);
    bind("CuteDSLRT_GetErrorString", &rt.GetErrorString);
  });
  if (!error.empty()) throw std::runtime_error("jax_cute: CuTe DSL runtime: " + error);
  g_runtime_path = path;
}

// Makes the stream's context current on this thread while in scope, unless it is already (as
// under XLA, which this checks with one query).
struct StreamContext {
  const Driver* pushed = nullptr;
  ~StreamContext() { CUcontext popped; if (pushed != nullptr) pushed->CtxPopCurrent(&popped); }
  ffi::Error Enter(const Driver& d, cudaStream_t stream) {
    // cuStreamGetCtx costs about a microsecond a launch, so each thread remembers the last
    // stream it found with its context current (XLA launches on a few long-lived streams).
    thread_local cudaStream_t verified_stream = nullptr;
    thread_local CUcontext verified_context = nullptr;
    CUcontext want = nullptr, have = nullptr;
    if (stream == verified_stream && d.CtxGetCurrent(&have) == 0 && have == verified_context)
      return ffi::Error::Success();
    CUresult r = d.StreamGetCtx(stream, &want);
    if (r == 0 && d.CtxGetCurrent(&have) == 0 && have == want) {
      verified_stream = stream;
      verified_context = want;
      return ffi::Error::Success();
    }
    if (r == 0 && (r = d.CtxPushCurrent(want)) == 0) pushed = &d;
    if (r == 0) return ffi::Error::Success();
    return Err(Code::kInternal, "cannot make the stream's context current: " + d.Describe(r));
  }
};

template <typename T>
bool ReadAt(ffi::Span<const uint8_t> obj, uint64_t off, T* out) {
  if (off > obj.size() || sizeof(T) > obj.size() - off) return false;
  std::memcpy(out, obj.begin() + off, sizeof(T));
  return true;
}

// SHA-256 (FIPS 180-4) as lowercase hex: the `key` attribute is the object's digest, and a call
// whose key and object disagree is refused (its object is not the one its key names).
std::string Sha256Hex(const uint8_t* data, size_t size) {
  static constexpr uint32_t k[64] = {
      0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
      0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
      0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
      0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
      0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
      0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
      0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
      0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  auto rotr = [](uint32_t x, int n) { return (x >> n) | (x << (32 - n)); };
  auto block = [&](const uint8_t* p) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = uint32_t{p[4 * i]} << 24 | uint32_t{p[4 * i + 1]} << 16 | uint32_t{p[4 * i + 2]} << 8 |
             uint32_t{p[4 * i + 3]};
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
  };
  size_t done = 0;
  for (; size - done >= 64; done += 64) block(data + done);
  uint8_t tail[128] = {};
  const size_t rest = size - done;
  if (rest > 0) std::memcpy(tail, data + done, rest);
  tail[rest] = 0x80;
  const size_t tail_size = rest < 56 ? 64 : 128;
  const uint64_t bits = uint64_t{size} * 8;
  for (int i = 0; i < 8; ++i) tail[tail_size - 1 - i] = uint8_t(bits >> (8 * i));
  block(tail);
  if (tail_size == 128) block(tail + 64);
  std::string hex;
  for (uint32_t v : h) hex += Format("%08x", v);
  return hex;
}

// True when the ELF64 little-endian object defines the symbols `prefix`_function_name and
// `prefix`_version that every dumped launcher has. CuteDSLRT_Module_Get_Function aborts the
// process (an uncaught C++ exception) on a prefix the object lacks, so instantiate checks first.
// We read the symbol table rather than search bytes: string tables may share tails, so a byte
// search could not tell "jc_a_version" from a longer name ending in it.
bool DefinesFunction(ffi::Span<const uint8_t> obj, const std::string& prefix) {
  Elf64_Ehdr eh;
  if (prefix.empty() || !ReadAt(obj, 0, &eh) || std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 ||
      eh.e_ident[EI_CLASS] != ELFCLASS64 || eh.e_ident[EI_DATA] != ELFDATA2LSB ||
      eh.e_shentsize < sizeof(Elf64_Shdr)) {
    return false;
  }
  const std::string function_name = prefix + "_function_name", version = prefix + "_version";
  int found = 0;  // bit 0: function_name, bit 1: version
  for (uint64_t i = 0; i < eh.e_shnum; ++i) {
    Elf64_Shdr sh, strsh;
    if (!ReadAt(obj, eh.e_shoff + i * eh.e_shentsize, &sh)) return false;
    if (sh.sh_type != SHT_SYMTAB) continue;
    if (sh.sh_link >= eh.e_shnum || sh.sh_entsize < sizeof(Elf64_Sym) ||
        !ReadAt(obj, eh.e_shoff + uint64_t{sh.sh_link} * eh.e_shentsize, &strsh) ||
        strsh.sh_offset > obj.size() || strsh.sh_size > obj.size() - strsh.sh_offset) {
      return false;
    }
    const char* strtab = reinterpret_cast<const char*>(obj.begin() + strsh.sh_offset);
    for (uint64_t at = 0; at + sh.sh_entsize <= sh.sh_size; at += sh.sh_entsize) {
      Elf64_Sym sym;
      if (!ReadAt(obj, sh.sh_offset + at, &sym)) return false;
      if (sym.st_shndx == SHN_UNDEF || sym.st_name >= strsh.sh_size) continue;
      const size_t room = strsh.sh_size - sym.st_name;
      const std::string_view name(strtab + sym.st_name, strnlen(strtab + sym.st_name, room));
      if (name.size() == room) continue;  // not NUL-terminated inside the table
      found |= (name == function_name ? 1 : 0) | (name == version ? 2 : 0);
    }
  }
  return found == 3;
}

std::atomic<int64_t> g_modules_created{0}, g_functions_loaded{0}, g_launches{0};
// A kernel's launcher per device, set once under g_mu and never unloaded (unloading CUDA code
// while the process tears CUDA down is a known source of crashes at exit).
constexpr int kMaxDevices = 64;
using Kernel = std::array<std::atomic<DslFunction*>, kMaxDevices>;
// The process's kernels by (object digest, symbol, declared arch): with the arch in the key, a
// call site declaring the wrong arch for a loaded object still meets the arch check.
Kernel* KernelFor(const std::string& key) {
  static auto* kernels = new std::map<std::string, Kernel>();
  std::lock_guard<std::mutex> lock(g_mu);
  return &kernels->try_emplace(key).first->second;
}

// Everything instantiate parsed from the attributes; read-only afterwards.
struct LaunchState {
  static inline ffi::TypeId id = {};
  std::string name;            // for error messages
  std::string symbol;          // function prefix inside the object
  int arch_major, arch_minor;  // a validated compute capability
  Kernel* kernel;
  std::vector<int64_t> kinds;    // per argument: -1 stream, -2 scalar, k >= 0 buffer k
  std::vector<int64_t> offsets;  // kinds.size() + 1 offsets into words
  std::vector<int64_t> words;    // descriptor templates
  std::vector<int64_t> align;    // per argument: required byte alignment of the buffer (0: none)
  std::vector<int64_t> dtypes;   // per buffer argument: its ffi::DataType code
  std::vector<int64_t> ranks;    // per buffer argument: its rank
  std::vector<int64_t> bytes;    // per buffer argument: the bytes its descriptor reaches
  std::vector<std::string> names;  // per argument, for error messages
};

// The launcher of `s` on `device`, loaded once per process by whichever call comes first, after
// checking the compute capability (the object holds SASS for one arch only). The lookup loads
// the CUDA library into the current context, so the stream's must be.
ffi::Error GetFunction(const LaunchState& s, ffi::Dictionary& attrs, int32_t device,
                       cudaStream_t stream, DslFunction** fn) {
  if (device < 0 || device >= kMaxDevices) {
    return Err(Code::kUnimplemented, Format("kernel %s: device ordinal %d >= %d", s.name.c_str(),
                                            device, kMaxDevices));
  }
  std::atomic<DslFunction*>& slot = (*s.kernel)[device];
  if ((*fn = slot.load(std::memory_order_acquire)) != nullptr) return ffi::Error::Success();
  std::lock_guard<std::mutex> lock(g_mu);
  if ((*fn = slot.load(std::memory_order_relaxed)) != nullptr) return ffi::Error::Success();
  const std::string kernel = "kernel " + s.name + ": ";
  if (g_runtime == nullptr) return Err(Code::kFailedPrecondition, kernel + "no CuTe DSL runtime");
  if (std::string error = LoadDriverLocked(); !error.empty())
    return Err(Code::kFailedPrecondition, kernel + error);
  const Driver& d = *g_driver;
  const DslRuntime& rt = *g_runtime;
  StreamContext context;
  if (ffi::Error e = context.Enter(d, stream); e.failure()) return e;
  int dev = 0, major = 0, minor = 0;
  CUresult r = d.CtxGetDevice(&dev);
  if (r == 0) r = d.DeviceGetAttribute(&major, 75, dev);  // ..._COMPUTE_CAPABILITY_MAJOR
  if (r == 0) r = d.DeviceGetAttribute(&minor, 76, dev);  // ..._COMPUTE_CAPABILITY_MINOR
  if (r != 0) return Err(Code::kInternal, kernel + "cannot query the device: " + d.Describe(r));
  if (major != s.arch_major || minor != s.arch_minor) {
    return Err(Code::kFailedPrecondition, Format("kernel %s was compiled for sm_%d%d (compute "
        "capability %d.%d), device %d is compute capability %d.%d", s.name.c_str(), s.arch_major,
        s.arch_minor, s.arch_major, s.arch_minor, device, major, minor));
  }
  auto object = attrs.get<ffi::Span<const uint8_t>>("object");
  if (!object.has_value()) return object.error();
  DslModule* module = nullptr;
  DslFunction* loaded = nullptr;
  std::string failed;  // the step that failed and why
  try {
    int rc = rt.ModuleCreateFromBytes(&module, object->begin(), object->size(), nullptr, 0);
    if (rc != 0) {
      failed = "CuteDSLRT_Module_Create_From_Bytes failed: " + rt.Describe(rc);
    } else {
      g_modules_created++;
      rc = rt.ModuleGetFunction(&loaded, module, s.symbol.c_str());
      if (rc != 0) failed = "CuteDSLRT_Module_Get_Function('" + s.symbol + "'): " + rt.Describe(rc);
    }
  } catch (...) {
    failed = "the CuTe DSL runtime threw while loading '" + s.symbol + "'";
  }
  if (!failed.empty() || loaded == nullptr) {
    if (module != nullptr) rt.ModuleDestroy(module);
    return Err(Code::kInternal, kernel + Format("on device %d: ", device) +
                                    (failed.empty() ? "the runtime returned no function" : failed));
  }
  g_functions_loaded++;
  slot.store(*fn = loaded, std::memory_order_release);
  return ffi::Error::Success();
}

// Attributes only; no device, stream or buffers yet. Runs on any XLA backend.
// A tensor descriptor is the data pointer, then int32 shapes and int64 strides of at most this
// many dynamic modes each.
constexpr int64_t kMaxModes = 16;

std::vector<std::string> SplitNames(std::string_view text) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i <= text.size(); ++i) {
    if (i == text.size() || text[i] == ',') {
      out.emplace_back(text.substr(start, i - start));
      start = i + 1;
    }
  }
  return out;
}

ffi::ErrorOr<std::unique_ptr<LaunchState>> Instantiate(
    std::string_view name, std::string_view key, std::string_view symbol,
    ffi::Span<const uint8_t> object, int64_t arch_major, int64_t arch_minor,
    ffi::Span<const int64_t> kinds, ffi::Span<const int64_t> offsets,
    ffi::Span<const int64_t> words, ffi::Span<const int64_t> align,
    ffi::Span<const int64_t> dtypes, ffi::Span<const int64_t> ranks,
    ffi::Span<const int64_t> bytes, std::string_view arg_names) {
  auto error = [&](const std::string& why) {
    return ffi::Unexpected(Err(Code::kInvalidArgument, "kernel " + std::string(name) + ": " + why));
  };
  auto bad = [&](const std::string& why) { return error("malformed call: " + why); };
  const size_t n = kinds.size();
  if (offsets.size() != n + 1)
    return bad(Format("arg_offsets has %zu entries, arg_kinds %zu", offsets.size(), n));
  if (align.size() != n)
    return bad(Format("arg_align has %zu entries, arg_kinds %zu", align.size(), n));
  if (dtypes.size() != n || ranks.size() != n || bytes.size() != n)
    return bad(Format("arg_dtypes, arg_ranks and arg_bytes have %zu, %zu and %zu entries, "
                      "arg_kinds %zu", dtypes.size(), ranks.size(), bytes.size(), n));
  std::vector<std::string> names = SplitNames(arg_names);
  if (names.size() != n)
    return bad(Format("arg_names names %zu arguments, arg_kinds %zu", names.size(), n));
  if (offsets[0] != 0) return bad("arg_offsets must start at 0");
  if (offsets[n] != static_cast<int64_t>(words.size()))
    return bad(Format("arg_offsets ends at %" PRId64 " but arg_words has %zu words", offsets[n],
                      words.size()));
  for (size_t i = 0; i < n; ++i) {
    if (offsets[i + 1] <= offsets[i])  // every argument has a descriptor word at least
      return bad(Format("arg_offsets must increase, but not at argument %zu", i));
    if (kinds[i] < -2) return bad(Format("argument %zu has unknown kind %" PRId64, i, kinds[i]));
    if (align[i] < 0 || (align[i] & (align[i] - 1)) != 0)
      return bad(Format("argument %zu: alignment %" PRId64 " is not a power of two", i, align[i]));
    // A descriptor's length: one word for a stream or a scalar; a tensor's pointer, then its
    // dynamic int32 shapes and int64 strides.
    const int64_t length = offsets[i + 1] - offsets[i];
    const char* arg = names[i].c_str();
    if (kinds[i] < 0 && length != 1)
      return bad(Format("argument %zu ('%s'): a %s takes one descriptor word, not %" PRId64, i, arg,
                        kinds[i] == -1 ? "stream" : "scalar", length));
    if (kinds[i] >= 0 && length > 1 + kMaxModes / 2 + kMaxModes)
      return bad(Format("argument %zu ('%s'): a tensor descriptor of %" PRId64 " words holds more "
                        "than %" PRId64 " dynamic modes", i, arg, length, kMaxModes));
    if (kinds[i] >= 0 && (dtypes[i] <= 0 || dtypes[i] > 255 || ranks[i] < 0 || bytes[i] < 0))
      return bad(Format("argument %zu ('%s'): dtype %" PRId64 ", rank %" PRId64 " or size %" PRId64
                        " is not a buffer's", i, arg, dtypes[i], ranks[i], bytes[i]));
  }
  if (arch_major <= 0 || arch_major > 99 || arch_minor < 0 || arch_minor > 9)
    return bad(Format("arch %" PRId64 ".%" PRId64 " is not a compute capability", arch_major,
                      arch_minor));
  if (key.empty()) return bad("empty key");
  if (std::string digest = Sha256Hex(object.begin(), object.size()); key != digest)
    return error("its key " + std::string(key) + " is not the sha256 of its object (" + digest +
                 "): the object is not the one the call names");
  const std::string prefix(symbol);
  if (!DefinesFunction(object, prefix))
    return error(Format("its object (%zu bytes) is not an ELF object defining function '%s'",
                        object.size(), prefix.c_str()));
  Kernel* kernel = KernelFor(std::string(key) + "/" + prefix + "/" + std::to_string(arch_major) +
                             "." + std::to_string(arch_minor));
  return ffi::ErrorOr<std::unique_ptr<LaunchState>>(std::unique_ptr<LaunchState>(new LaunchState{
      std::string(name), prefix, int(arch_major), int(arch_minor), kernel,
      {kinds.begin(), kinds.end()}, {offsets.begin(), offsets.end()}, {words.begin(), words.end()},
      {align.begin(), align.end()}, {dtypes.begin(), dtypes.end()}, {ranks.begin(), ranks.end()},
      {bytes.begin(), bytes.end()}, std::move(names)}));
}

// Device and stream known; runs before execution, not in graph replays.
ffi::Error Initialize(cudaStream_t stream, int32_t device, LaunchState* state,
                      ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  DslFunction* fn = nullptr;
  return GetFunction(*state, attrs, device, stream, &fn);
}
// The hot path: may run from several threads at once on one state.
ffi::Error Execute(cudaStream_t stream, int32_t device, LaunchState* state,
                   ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  const LaunchState& s = *state;
  // Initialize loaded it unless XLA skipped that stage (it may on some paths): then load here.
  DslFunction* fn = nullptr;
  if (ffi::Error e = GetFunction(s, attrs, device, stream, &fn); e.failure()) return e;
  // Per-thread scratch: a warm launch allocates nothing. Buffers are inputs, then outputs; each
  // argument points into `storage`: a stream, a scalar or a descriptor (word 0: data pointer).
  struct Buffer {
    void* data;
    int64_t dtype, rank;
    size_t bytes;
  };
  thread_local std::vector<Buffer> buffers;
  thread_local std::vector<void*> argv;
  thread_local std::vector<int64_t> storage;
  buffers.clear();
  auto add = [](const ffi::AnyBuffer& b) {
    buffers.push_back({b.untyped_data(), static_cast<int64_t>(b.element_type()),
                       static_cast<int64_t>(b.dimensions().size()), b.size_bytes()});
  };
  for (size_t k = 0; k < args.size(); ++k) {
    auto buffer = args.get<ffi::AnyBuffer>(k);
    if (!buffer.has_value()) return buffer.error();
    add(*buffer);
  }
  for (size_t k = 0; k < rets.size(); ++k) {
    auto buffer = rets.get<ffi::AnyBuffer>(k);
    if (!buffer.has_value()) return buffer.error();
    add(**buffer);
  }
  const size_t n = s.kinds.size();
  argv.resize(n + 1);
  storage.assign(s.words.begin(), s.words.end());
  for (size_t i = 0; i < n; ++i) {
    const int64_t k = s.kinds[i];
    argv[i] = storage.data() + s.offsets[i];
    if (k == -1) std::memcpy(argv[i], &stream, sizeof(stream));
    if (k < 0) continue;
    const char* arg = s.names[i].c_str();
    if (static_cast<size_t>(k) >= buffers.size()) {
      return Err(Code::kInvalidArgument, Format("kernel %s: argument %zu ('%s') is buffer %" PRId64
                 " of only %zu", s.name.c_str(), i, arg, k, buffers.size()));
    }
    const Buffer& b = buffers[k];
    if (b.dtype != s.dtypes[i] || b.rank != s.ranks[i]) {
      return Err(Code::kInvalidArgument, Format("kernel %s: argument %zu ('%s', buffer %" PRId64
                 ") is a rank-%" PRId64 " buffer of dtype %" PRId64 "; its descriptor was packed for "
                 "rank %" PRId64 ", dtype %" PRId64 " (XLA FFI DataType codes)", s.name.c_str(), i,
                 arg, k, b.rank, b.dtype, s.ranks[i], s.dtypes[i]));
    }
    if (b.bytes < static_cast<uint64_t>(s.bytes[i])) {
      return Err(Code::kInvalidArgument, Format("kernel %s: argument %zu ('%s', buffer %" PRId64
                 ") has %zu bytes; its descriptor reaches %" PRId64, s.name.c_str(), i, arg, k,
                 b.bytes, s.bytes[i]));
    }
    if (s.align[i] > 0 && reinterpret_cast<uintptr_t>(b.data) % s.align[i] != 0) {
      return Err(Code::kInvalidArgument, Format("kernel %s: argument %zu ('%s', buffer %" PRId64
                 ") at %p is not aligned to %" PRId64 " bytes, as the kernel assumes",
                 s.name.c_str(), i, arg, k, b.data, s.align[i]));
    }
    std::memcpy(argv[i], &b.data, sizeof(void*));
  }
  int32_t ret = 0;  // the launch's CUDA error, written by the launcher
  argv[n] = &ret;
  // The launcher sets attributes on the current device: make sure it is the stream's.
  StreamContext context;
  if (ffi::Error e = context.Enter(*g_driver, stream); e.failure()) return e;
  int rc = 0;
  try {
    rc = g_runtime->FunctionRun(fn, argv.data(), n + 1);
  } catch (...) {
    return Err(Code::kInternal, "kernel " + s.name + ": the CuTe DSL runtime threw");
  }
  g_launches++;
  if (rc == 0 && ret == 0) return ffi::Error::Success();
  std::string why = rc != 0 ? "CuteDSLRT_Function_Run failed: " + g_runtime->Describe(rc)
                            : "launch failed with CUDA error " + g_driver->Describe(ret);
  return Err(Code::kInternal, "kernel " + s.name + ": " + why);
}

}  // namespace

auto InstantiateBinding() {
  using Words = ffi::Span<const int64_t>;
  return ffi::Ffi::BindInstantiate()
      .Attr<std::string_view>("name").Attr<std::string_view>("key").Attr<std::string_view>("symbol")
      .Attr<ffi::Span<const uint8_t>>("object")
      .Attr<int64_t>("arch_major").Attr<int64_t>("arch_minor")
      .Attr<Words>("arg_kinds").Attr<Words>("arg_offsets").Attr<Words>("arg_words")
      .Attr<Words>("arg_align").Attr<Words>("arg_dtypes").Attr<Words>("arg_ranks")
      .Attr<Words>("arg_bytes").Attr<std::string_view>("arg_names");
}

// What Initialize and Execute both take: stream, device, state, buffers and attributes.
template <typename Binder>
auto WithLaunchContext(Binder binder) {
  return std::move(binder).template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>().template Ctx<ffi::State<LaunchState>>()
      .RemainingArgs().RemainingRets().Attrs();
}

// Graph handlers: XLA may record the launch into a command buffer (CUDA graph) by stream capture.
// Every stage declares the trait: XLA may read it from whichever stage's handler it asks.
constexpr auto kGraph = ffi::Traits::kCmdBufferCompatible;
XLA_FFI_DEFINE_HANDLER(kInstantiate, Instantiate, InstantiateBinding(), {kGraph});
XLA_FFI_DEFINE_HANDLER(kInitialize, Initialize, WithLaunchContext(ffi::Ffi::BindInitialize()),
                       {kGraph});
XLA_FFI_DEFINE_HANDLER(kExecute, Execute, WithLaunchContext(ffi::Ffi::Bind()), {kGraph});

// Stream handlers: without the trait, XLA launches on its stream every run, so a kernel using
// programmatic dependent launch can overlap the one before (not so in a child graph).
XLA_FFI_DEFINE_HANDLER(kInstantiateStream, Instantiate, InstantiateBinding());
XLA_FFI_DEFINE_HANDLER(kInitializeStream, Initialize,
                       WithLaunchContext(ffi::Ffi::BindInitialize()));
XLA_FFI_DEFINE_HANDLER(kExecuteStream, Execute, WithLaunchContext(ffi::Ffi::Bind()));

}  // namespace jax_cute

NB_MODULE(_ffi, m) {
  using namespace jax_cute;
  using Capsules = std::map<std::string, nb::capsule>;
  auto capsule = [](auto* p) { return nb::capsule(reinterpret_cast<void*>(p)); };
  m.doc() = "jax_cute's XLA FFI handler for CuTe DSL launchers (target 'jax_cute_launch').";
  m.def("set_runtime_library", &SetRuntimeLibrary, nb::arg("path"),
        "Load libcute_dsl_runtime.so from `path` once; RuntimeError if that fails.");
  m.def("registrations", [capsule](bool graph) {
    return Capsules{{"instantiate", capsule(graph ? kInstantiate : kInstantiateStream)},
                    {"initialize", capsule(graph ? kInitialize : kInitializeStream)},
                    {"execute", capsule(graph ? kExecute : kExecuteStream)}};
  }, nb::arg("command_buffer") = true, "Stage -> handler capsule, for register_ffi_target.");
  m.def("state_type", [capsule] {
    static auto type_info = ffi::MakeTypeInfo<LaunchState>();
    return Capsules{{"type_id", capsule(&LaunchState::id)}, {"type_info", capsule(&type_info)}};
  }, "The handler's state type, for jax.ffi.register_ffi_type.");
  m.def("stats", [] {
    return std::map<std::string, int64_t>{{"modules_created", g_modules_created.load()},
                                          {"functions_loaded", g_functions_loaded.load()},
                                          {"launches", g_launches.load()}};
  }, "Counters: modules_created, functions_loaded, launches.");
}
