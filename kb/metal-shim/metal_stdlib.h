// ksearch Metal shim: lets a C++17 compiler (clang++ or g++) syntax- and type-check Metal
// Shading Language kernels on Linux, where no Metal compiler exists, and (with KS_METAL_EXEC
// defined) run them on the CPU.
//
// It models what kernels use: address-space qualifiers (erased), attributes (ignored by the
// compiler, `-w`), scalar and vector types (with swizzles, rewritten by ksearch), math,
// SIMD-group, barrier, atomic and simdgroup_matrix functions. Known gaps: single-component
// .r/.g/.b/.a, textures, matrix types other than simdgroup_matrix, and address-space mismatches
// (device vs threadgroup pointers are not told apart).
// Execution mode (KS_METAL_EXEC): half and bfloat are 16-bit storage rounded to
// nearest even; a threadgroup's threads are cooperatively scheduled fibers; barriers and SIMD-group
// functions are rendezvous of the threads (or lanes) that have not returned, and lanes that
// diverge to different SIMD-group calls take them one path after the other; threadgroup memory is
// a 32 KB arena per threadgroup, filled with NaN bytes before each one; a simdgroup_matrix holds
// its whole 8x8 matrix in every lane (a store writes the lane's two elements). Arithmetic on half
// runs in float and rounds on assignment.
// Names and signatures follow Apple's Metal Shading Language Specification.
#ifndef KSEARCH_METAL_SHIM_H
#define KSEARCH_METAL_SHIM_H
#if defined(KS_METAL_EXEC) && defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 600  // ucontext on macOS: before any system header
#endif

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#ifdef KS_METAL_EXEC
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <cstdio>
#include <vector>
#endif

// Address spaces and function qualifiers: erased.
#define device
#define threadgroup
#define constant
#define thread
#define kernel
#define METAL_FUNC inline
#define ks_threadgroup_index threadgroup_index

// Constants from metal_math.
#define INFINITY (__builtin_inff())
#define HUGE_VALF (__builtin_huge_valf())
#define NAN (__builtin_nanf(""))
#define FLT_MAX 3.402823466e+38F
#define FLT_MIN 1.175494351e-38F
#define FLT_EPSILON 1.192092896e-07F
#define HALF_MAX 65504.0f
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

// Half and bfloat: storage types that convert to and from float. Arithmetic happens in float
// and converts back on assignment, which is enough for type checking; in execution mode they are
// 16 bits wide and round to nearest even, as the GPU stores them.
#ifdef KS_METAL_EXEC
inline float ks_bits_f(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
inline uint32_t ks_f_bits(float f) { uint32_t u; __builtin_memcpy(&u, &f, 4); return u; }
inline uint16_t ks_f2h(float f) {
  const uint32_t x = ks_f_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds past 65504: inf
  if (ax < 0x38800000u) {                                   // below 2^-14: subnormal or zero
    const float r = ks_bits_f(ax) * 16777216.0f;            // * 2^24: the subnormal's integer
    return uint16_t(sign | uint32_t(__builtin_nearbyintf(r)));
  }
  const uint32_t m = ax + 0xfffu + ((ax >> 13) & 1u);       // round the 13 dropped bits to even
  return uint16_t(sign | ((m - 0x38000000u) >> 13));
}
inline float ks_h2f(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) return ks_bits_f(sign | ks_f_bits(float(m) * (1.0f / 16777216.0f)));
  if (e == 31) return ks_bits_f(sign | 0x7f800000u | (m << 13));
  return ks_bits_f(sign | ((e + 112u) << 23) | (m << 13));
}
inline uint16_t ks_f2bf(float f) {
  const uint32_t x = ks_f_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float ks_bf2f(uint16_t h) { return ks_bits_f(uint32_t(h) << 16); }
#define KS_SMALL_FLOAT(NAME, TO, FROM)                                                        \
  struct NAME {                                                                               \
    uint16_t bits;                                                                            \
    NAME() = default;                                                                         \
    NAME(float f) : bits(TO(f)) {}                                                            \
    operator float() const { return FROM(bits); }                                             \
    NAME& operator+=(float o) { return *this = NAME(float(*this) + o); }                      \
    NAME& operator-=(float o) { return *this = NAME(float(*this) - o); }                      \
    NAME& operator*=(float o) { return *this = NAME(float(*this) * o); }                      \
    NAME& operator/=(float o) { return *this = NAME(float(*this) / o); }                      \
  };
KS_SMALL_FLOAT(half, ks_f2h, ks_h2f)
KS_SMALL_FLOAT(bfloat, ks_f2bf, ks_bf2f)
#else
#define KS_SMALL_FLOAT(NAME)                                                                  \
  struct NAME {                                                                               \
    float v;                                                                                  \
    NAME() = default;                                                                         \
    constexpr NAME(float f) : v(f) {}                                                         \
    constexpr operator float() const { return v; }                                            \
    NAME& operator+=(float o) { v += o; return *this; }                                       \
    NAME& operator-=(float o) { v -= o; return *this; }                                       \
    NAME& operator*=(float o) { v *= o; return *this; }                                       \
    NAME& operator/=(float o) { v /= o; return *this; }                                       \
  };
KS_SMALL_FLOAT(half)
KS_SMALL_FLOAT(bfloat)
#endif
#undef KS_SMALL_FLOAT
typedef half float16_t;
typedef bfloat bfloat16_t;

template <class T> struct ks_is_scalar
    : std::integral_constant<bool, std::is_arithmetic<T>::value || std::is_same<T, half>::value ||
                                       std::is_same<T, bfloat>::value> {};
template <class T> struct ks_ident { typedef T type; };

// Vectors. Swizzles of two to four components (`v.xy`, `v.zyx`, `c.rgba`) are rewritten by
// ksearch to `v.template ks_sw<0, 1>()` before compiling: a copy of the components that writes
// back on assignment (`v.xy = ...`, `v.zw += ...`).
template <class T, int N> struct vec;
template <class T, int N, int... I> struct ks_swz : vec<T, int(sizeof...(I))> {
  typedef vec<T, int(sizeof...(I))> base;
  vec<T, N>* p;
  explicit ks_swz(vec<T, N>* v) : base((*v)[I]...), p(v) {}
  ks_swz& operator=(const base& o) {
    int k = 0;
    (void)std::initializer_list<int>{((*p)[I] = o[k++], 0)...};
    static_cast<base&>(*this) = o;
    return *this;
  }
  ks_swz& operator+=(const base& o) { return *this = base(*this) + o; }
  ks_swz& operator-=(const base& o) { return *this = base(*this) - o; }
  ks_swz& operator*=(const base& o) { return *this = base(*this) * o; }
  ks_swz& operator/=(const base& o) { return *this = base(*this) / o; }
};
#define KS_VEC_INDEX(N)                                                                       \
  T& operator[](int i) { return (&x)[i]; }                                                    \
  const T& operator[](int i) const { return (&x)[i]; }                                        \
  template <int... I> ks_swz<T, N, I...> ks_sw() const {                                      \
    static_assert(sizeof...(I) >= 2 && sizeof...(I) <= 4, "a swizzle has 2 to 4 components"); \
    return ks_swz<T, N, I...>(const_cast<vec*>(this));                                        \
  }
template <class T> struct vec<T, 2> {
  T x, y;
  vec() = default;
  constexpr vec(T s) : x(s), y(s) {}
  constexpr vec(T a, T b) : x(a), y(b) {}
  template <class U> explicit vec(const vec<U, 2>& o) : x(T(o.x)), y(T(o.y)) {}
  KS_VEC_INDEX(2)
};
template <class T> struct vec<T, 3> {
  T x, y, z;
  vec() = default;
  constexpr vec(T s) : x(s), y(s), z(s) {}
  constexpr vec(T a, T b, T c) : x(a), y(b), z(c) {}
  vec(const vec<T, 2>& a, T c) : x(a.x), y(a.y), z(c) {}
  vec(T a, const vec<T, 2>& b) : x(a), y(b.x), z(b.y) {}
  template <class U> explicit vec(const vec<U, 3>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  KS_VEC_INDEX(3)
};
template <class T> struct vec<T, 4> {
  T x, y, z, w;
  vec() = default;
  constexpr vec(T s) : x(s), y(s), z(s), w(s) {}
  constexpr vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  vec(const vec<T, 2>& a, const vec<T, 2>& b) : x(a.x), y(a.y), z(b.x), w(b.y) {}
  vec(const vec<T, 2>& a, T c, T d) : x(a.x), y(a.y), z(c), w(d) {}
  vec(T a, T b, const vec<T, 2>& c) : x(a), y(b), z(c.x), w(c.y) {}
  vec(const vec<T, 3>& a, T d) : x(a.x), y(a.y), z(a.z), w(d) {}
  vec(T a, const vec<T, 3>& b) : x(a), y(b.x), z(b.y), w(b.z) {}
  template <class U> explicit vec(const vec<U, 4>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
  KS_VEC_INDEX(4)
};
#undef KS_VEC_INDEX

#define KS_VEC_OP(OP)                                                                         \
  template <class T, int N> vec<T, N> operator OP(vec<T, N> a, const vec<T, N>& b) {          \
    for (int i = 0; i < N; ++i) a[i] = a[i] OP b[i];                                          \
    return a;                                                                                 \
  }                                                                                           \
  template <class T, int N> vec<T, N> operator OP(vec<T, N> a, typename ks_ident<T>::type b) { \
    for (int i = 0; i < N; ++i) a[i] = a[i] OP b;                                             \
    return a;                                                                                 \
  }                                                                                           \
  template <class T, int N> vec<T, N> operator OP(typename ks_ident<T>::type a, vec<T, N> b) { \
    for (int i = 0; i < N; ++i) b[i] = a OP b[i];                                             \
    return b;                                                                                 \
  }                                                                                           \
  template <class T, int N> vec<T, N>& operator OP##=(vec<T, N>& a, const vec<T, N>& b) {     \
    return a = a OP b;                                                                        \
  }                                                                                           \
  template <class T, int N> vec<T, N>& operator OP##=(vec<T, N>& a, typename ks_ident<T>::type b) { \
    return a = a OP b;                                                                        \
  }
KS_VEC_OP(+)
KS_VEC_OP(-)
KS_VEC_OP(*)
KS_VEC_OP(/)
KS_VEC_OP(%)
KS_VEC_OP(&)
KS_VEC_OP(|)
KS_VEC_OP(^)
KS_VEC_OP(<<)
KS_VEC_OP(>>)
#undef KS_VEC_OP
// Component-wise comparisons give bool vectors; any / all reduce them.
#define KS_VEC_CMP(OP)                                                                        \
  template <class T, int N> vec<bool, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) { \
    vec<bool, N> r;                                                                           \
    for (int i = 0; i < N; ++i) r[i] = a[i] OP b[i];                                          \
    return r;                                                                                 \
  }                                                                                           \
  template <class T, int N> vec<bool, N> operator OP(const vec<T, N>& a, typename ks_ident<T>::type b) { \
    vec<bool, N> r;                                                                           \
    for (int i = 0; i < N; ++i) r[i] = a[i] OP b;                                             \
    return r;                                                                                 \
  }
KS_VEC_CMP(==)
KS_VEC_CMP(!=)
KS_VEC_CMP(<)
KS_VEC_CMP(<=)
KS_VEC_CMP(>)
KS_VEC_CMP(>=)
#undef KS_VEC_CMP
template <class T, int N> vec<T, N> operator-(vec<T, N> a) {
  for (int i = 0; i < N; ++i) a[i] = -a[i];
  return a;
}

#define KS_VEC_TYPES(T, P)                                                                    \
  typedef vec<T, 2> P##2;                                                                     \
  typedef vec<T, 3> P##3;                                                                     \
  typedef vec<T, 4> P##4;
KS_VEC_TYPES(float, float)
KS_VEC_TYPES(half, half)
KS_VEC_TYPES(bfloat, bfloat)
KS_VEC_TYPES(int, int)
KS_VEC_TYPES(uint, uint)
KS_VEC_TYPES(short, short)
KS_VEC_TYPES(ushort, ushort)
KS_VEC_TYPES(char, char)
KS_VEC_TYPES(uchar, uchar)
KS_VEC_TYPES(long, long)
KS_VEC_TYPES(ulong, ulong)
KS_VEC_TYPES(bool, bool)
KS_VEC_TYPES(float, packed_float)
KS_VEC_TYPES(half, packed_half)
#undef KS_VEC_TYPES

namespace metal {

// Math (metal_math), scalar and element-wise on vectors.
template <class T> using ks_scalar_t = typename std::enable_if<ks_is_scalar<T>::value, T>::type;
#define KS_MATH1(NAME, EXPR)                                                                  \
  template <class T> inline ks_scalar_t<T> NAME(T x) { float f = float(x); return T(EXPR); }  \
  template <class T, int N> inline vec<T, N> NAME(vec<T, N> v) {                              \
    for (int i = 0; i < N; ++i) v[i] = NAME(v[i]);                                            \
    return v;                                                                                 \
  }
#define KS_MATH_LIST                                                                          \
  KS_MATH1(exp, __builtin_expf(f))                                                            \
  KS_MATH1(exp2, __builtin_exp2f(f))                                                          \
  KS_MATH1(exp10, __builtin_powf(10.0f, f))                                                   \
  KS_MATH1(log, __builtin_logf(f))                                                            \
  KS_MATH1(log2, __builtin_log2f(f))                                                          \
  KS_MATH1(log10, __builtin_log10f(f))                                                        \
  KS_MATH1(sqrt, __builtin_sqrtf(f))                                                          \
  KS_MATH1(rsqrt, 1.0f / __builtin_sqrtf(f))                                                  \
  KS_MATH1(sin, __builtin_sinf(f))                                                            \
  KS_MATH1(cos, __builtin_cosf(f))                                                            \
  KS_MATH1(tan, __builtin_tanf(f))                                                            \
  KS_MATH1(tanh, __builtin_tanhf(f))                                                          \
  KS_MATH1(sinh, __builtin_sinhf(f))                                                          \
  KS_MATH1(cosh, __builtin_coshf(f))                                                          \
  KS_MATH1(atan, __builtin_atanf(f))                                                          \
  KS_MATH1(fabs, __builtin_fabsf(f))                                                          \
  KS_MATH1(floor, __builtin_floorf(f))                                                        \
  KS_MATH1(ceil, __builtin_ceilf(f))                                                          \
  KS_MATH1(round, __builtin_roundf(f))                                                        \
  KS_MATH1(trunc, __builtin_truncf(f))                                                        \
  KS_MATH1(rint, __builtin_rintf(f))                                                          \
  KS_MATH1(fract, f - __builtin_floorf(f))                                                    \
  KS_MATH1(saturate, f < 0.0f ? 0.0f : (f > 1.0f ? 1.0f : f))                                 \
  KS_MATH1(sign, f > 0.0f ? 1.0f : (f < 0.0f ? -1.0f : 0.0f))
KS_MATH_LIST

template <class T> inline ks_scalar_t<T> abs(T x) { return x < T(0) ? T(-x) : x; }
template <class T, int N> inline vec<T, N> abs(vec<T, N> v) {
  for (int i = 0; i < N; ++i) v[i] = abs(v[i]);
  return v;
}
#define KS_MATH2(NAME, EXPR)                                                                  \
  template <class T> inline ks_scalar_t<T> NAME(T a, typename ks_ident<T>::type b) { return T(EXPR); } \
  template <class T, int N> inline vec<T, N> NAME(vec<T, N> a, const vec<T, N>& b) {          \
    for (int i = 0; i < N; ++i) a[i] = NAME(a[i], b[i]);                                      \
    return a;                                                                                 \
  }                                                                                           \
  template <class T, int N> inline vec<T, N> NAME(vec<T, N> a, typename ks_ident<T>::type b) { \
    for (int i = 0; i < N; ++i) a[i] = NAME(a[i], b);                                         \
    return a;                                                                                 \
  }
KS_MATH2(max, a > b ? a : b)
KS_MATH2(min, a < b ? a : b)
KS_MATH2(fmax, a > b ? a : b)
KS_MATH2(fmin, a < b ? a : b)
KS_MATH2(pow, __builtin_powf(float(a), float(b)))
KS_MATH2(powr, __builtin_powf(float(a), float(b)))
KS_MATH2(fmod, __builtin_fmodf(float(a), float(b)))
KS_MATH2(atan2, __builtin_atan2f(float(a), float(b)))
KS_MATH2(copysign, __builtin_copysignf(float(a), float(b)))
KS_MATH2(step, float(b) < float(a) ? 0.0f : 1.0f)
KS_MATH2(divide, float(a) / float(b))
template <class T> inline ks_scalar_t<T> fma(T a, typename ks_ident<T>::type b, typename ks_ident<T>::type c) {
  return T(float(a) * float(b) + float(c));
}
template <class T, int N> inline vec<T, N> fma(vec<T, N> a, const vec<T, N>& b, const vec<T, N>& c) {
  return a * b + c;
}
template <class T> inline ks_scalar_t<T> clamp(T x, typename ks_ident<T>::type lo, typename ks_ident<T>::type hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}
template <class T, int N> inline vec<T, N> clamp(vec<T, N> x, typename ks_ident<T>::type lo, typename ks_ident<T>::type hi) {
  for (int i = 0; i < N; ++i) x[i] = clamp(x[i], lo, hi);
  return x;
}
template <class T> inline ks_scalar_t<T> mix(T a, typename ks_ident<T>::type b, typename ks_ident<T>::type t) {
  return T(float(a) + (float(b) - float(a)) * float(t));
}
template <class T> inline T select(T a, T b, bool c) { return c ? b : a; }
template <class T> inline bool isnan(T x) { return __builtin_isnan(float(x)); }
template <class T> inline bool isinf(T x) { return __builtin_isinf(float(x)); }
template <class T> inline bool isfinite(T x) { return __builtin_isfinite(float(x)); }
template <class T> inline T popcount(T x) { return T(__builtin_popcountll((unsigned long long)x)); }
template <class T> inline T clz(T x) { return T(x ? __builtin_clz((unsigned)x) : 32); }
template <class T> inline T ctz(T x) { return T(x ? __builtin_ctz((unsigned)x) : 32); }
template <class T, int N> inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = T(0);
  for (int i = 0; i < N; ++i) s = s + a[i] * b[i];
  return s;
}
template <int N> inline bool any(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (v[i]) return true;
  return false;
}
template <int N> inline bool all(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (!v[i]) return false;
  return true;
}
inline bool any(bool b) { return b; }
inline bool all(bool b) { return b; }
template <class T, class U> inline T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: sizes differ");
  T t;
  __builtin_memcpy(&t, &u, sizeof(T));
  return t;
}

namespace fast {
using metal::abs; using metal::ceil; using metal::clamp; using metal::cos; using metal::divide;
using metal::exp; using metal::exp10; using metal::exp2; using metal::fabs; using metal::floor;
using metal::fmax; using metal::fmin; using metal::log; using metal::log10; using metal::log2;
using metal::max; using metal::min; using metal::pow; using metal::powr; using metal::rsqrt;
using metal::sin; using metal::sqrt; using metal::tan; using metal::tanh; using metal::fract;
using metal::round; using metal::trunc; using metal::atan2; using metal::saturate;
}  // namespace fast
namespace precise {
using namespace fast;
}  // namespace precise

template <class T> struct numeric_limits {
  static constexpr T infinity() { return T(__builtin_inff()); }
  static constexpr T quiet_NaN() { return T(__builtin_nanf("")); }
  static constexpr T max() { return T(3.402823466e+38F); }
  static constexpr T min() { return T(1.175494351e-38F); }
  static constexpr T lowest() { return T(-3.402823466e+38F); }
  static constexpr T epsilon() { return T(1.192092896e-07F); }
};

// Synchronisation (metal_compute).
enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(unsigned(a) | unsigned(b)); }
enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release, memory_order_acq_rel, memory_order_seq_cst };
enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };
#ifdef KS_METAL_EXEC
}  // namespace metal

// ---- the executor: a threadgroup's threads as cooperatively scheduled fibers ----
namespace ks {
[[noreturn]] inline void fail(const char* what) {
  fprintf(stderr, "metal-emu: %s\n", what);
  fflush(stderr);
  _exit(3);
}
enum : int { RUN = 0, AT_TG = 1, AT_SIMD = 2, DONE = 3 };
constexpr int SIMD = 32;
constexpr size_t TG_BYTES = 32768;  // Apple GPUs' threadgroup memory
constexpr size_t STACK = 256 * 1024;  // per thread; a deeper stack faults on its guard page
struct Lane {
  ucontext_t ctx;
  int state;
};
// What the lanes of one call of a SIMD-group function deposited (`mask`: the lanes that took
// part); each participant reads it until its next SIMD-group function.
struct Snap {
  unsigned mask;
  int refs;
  alignas(16) unsigned char v[SIMD][64];
};
struct SimdGroup {
  int waiting;      // lanes blocked at a SIMD-group function
  int site[SIMD];   // the call site (line in the kernel and function) a waiting lane is at; 0: none
  int held[SIMD];   // the snapshot a lane reads; -1: none
  alignas(16) unsigned char val[SIMD][64];
  Snap snaps[SIMD + 1];
  void reset() {
    waiting = 0;
    for (int l = 0; l < SIMD; l++) site[l] = 0, held[l] = -1;
    for (auto& x : snaps) x.refs = 0;
  }
};
struct Group {
  int n = 0, live = 0, cur = 0, tg_waiting = 0;
  std::vector<Lane> lanes;
  std::vector<SimdGroup> sgs;  // grown only: their buffers are not cleared per threadgroup
  std::vector<char*> stacks;
  ucontext_t sched;
  void (*body_fn)(int) = nullptr;
  alignas(64) unsigned char mem[TG_BYTES];
  size_t used = 0;
  std::vector<std::pair<int, size_t>> decls;
};
inline Group& G() {
  static Group* g = new Group();
  return *g;
}
// Threadgroup storage declared at `id`: one per threadgroup, allocated by its first thread.
template <class T> T* tg_alloc(int id) {
  Group& g = G();
  for (auto& d : g.decls)
    if (d.first == id) return reinterpret_cast<T*>(g.mem + d.second);
  const size_t off = (g.used + alignof(T) - 1 + 15) / 16 * 16;
  if (off + sizeof(T) > TG_BYTES) fail("threadgroup memory over 32 KB (Apple GPUs' limit)");
  g.used = off + sizeof(T);
  g.decls.push_back({id, off});
  return reinterpret_cast<T*>(g.mem + off);
}
inline void block(int st) {
  Group& g = G();
  const int i = g.cur;
  g.lanes[i].state = st;
  swapcontext(&g.lanes[i].ctx, &g.sched);
}
inline int live_in(int sg) {
  Group& g = G();
  int c = 0;
  for (int i = sg * SIMD; i < g.n && i < (sg + 1) * SIMD; i++) c += g.lanes[i].state != DONE;
  return c;
}
// The call at `site` of SIMD-group sg completes for the lanes waiting there: they read a
// snapshot of their deposits and run again.
inline void simd_complete(int sg, int site) {
  Group& g = G();
  SimdGroup& s = g.sgs[sg];
  int k = 0;
  while (s.snaps[k].refs > 0) k++;  // at most one snapshot per lane is held: one is free
  Snap& sn = s.snaps[k];
  sn.mask = 0;
  for (int l = 0; l < SIMD; l++) {
    if (s.site[l] != site) continue;
    sn.mask |= 1u << l;
    __builtin_memcpy(sn.v[l], s.val[l], 64);
    s.site[l] = 0;
    s.held[l] = k;
    s.waiting--;
    Lane& lane = g.lanes[sg * SIMD + l];
    if (lane.state == AT_SIMD) lane.state = RUN;
  }
  sn.refs = __builtin_popcount(sn.mask);
}
// Complete sg's pending call if every lane that has not returned waits at it.
inline bool simd_try_complete(int sg) {
  SimdGroup& s = G().sgs[sg];
  if (s.waiting == 0 || s.waiting != live_in(sg)) return false;
  int site = 0;
  for (int l = 0; l < SIMD; l++) {
    if (s.site[l] == 0) continue;
    if (site != 0 && s.site[l] != site) return false;  // lanes at different calls: resolved when nothing else can run
    site = s.site[l];
  }
  simd_complete(sg, site);
  return true;
}
inline void simd_drop(int sg, int l) {
  SimdGroup& s = G().sgs[sg];
  if (s.held[l] >= 0) s.snaps[s.held[l]].refs--;
  s.held[l] = -1;
}
inline void tg_release() {
  Group& g = G();
  for (int i = 0; i < g.n; i++)
    if (g.lanes[i].state == AT_TG) g.lanes[i].state = RUN;
  g.tg_waiting = 0;
}
inline void tg_barrier() {
  Group& g = G();
  if (g.tg_waiting + 1 == g.live) {
    tg_release();
    return;
  }
  g.tg_waiting++;
  block(AT_TG);
}
// A SIMD-group function: the lane deposits `v` and waits until its call completes, for every
// lane of the SIMD-group that has not returned when they all reach it, else (divergent lanes,
// once nothing else can run) for the lanes at the same call (`site`: its line in the kernel and
// the function), as the GPU runs divergent paths one after the other. Returns the deposits;
// `mask`: the lanes that took part.
inline const unsigned char (*collect(const void* v, size_t n, int site, unsigned& mask, int& lane))[64] {
  Group& g = G();
  const int i = g.cur, sg = i / SIMD;
  lane = i % SIMD;
  SimdGroup& s = g.sgs[sg];
  simd_drop(sg, lane);
  s.site[lane] = site != 0 ? site : 1;
  __builtin_memcpy(s.val[lane], v, n);
  s.waiting++;
  if (!simd_try_complete(sg)) block(AT_SIMD);
  const Snap& sn = s.snaps[s.held[lane]];
  mask = sn.mask;
  return sn.v;
}
template <class T> T poisoned() {
  T t;
  __builtin_memset(&t, 0xff, sizeof(T));
  return t;
}
template <class T> T lane_value(const unsigned char (*s)[64], unsigned mask, int l) {
  if (l < 0 || l >= SIMD || !((mask >> l) & 1u)) return poisoned<T>();  // an inactive lane
  T t;
  __builtin_memcpy(&t, s[l], sizeof(T));
  return t;
}
inline void trampoline(int idx) {
  Group& g = G();
  g.body_fn(idx);
  g.lanes[idx].state = DONE;
  g.live--;
  const int sg = idx / SIMD;
  simd_drop(sg, idx % SIMD);
  simd_try_complete(sg);
  if (g.tg_waiting > 0 && g.tg_waiting == g.live) tg_release();
  setcontext(&g.sched);
}
// Run one threadgroup of n threads to completion.
inline void run_group(int n, void (*fn)(int)) {
  Group& g = G();
  while ((int)g.stacks.size() < n) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    char* p = (char*)mmap(nullptr, STACK + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == (char*)MAP_FAILED) fail("no memory for thread stacks");
    mprotect(p, page, PROT_NONE);  // guard: a stack overflow faults
    g.stacks.push_back(p + page);
  }
  g.n = n;
  g.live = n;
  g.tg_waiting = 0;
  g.body_fn = fn;
  g.lanes.assign(n, Lane());
  const size_t nsg = (n + SIMD - 1) / SIMD;
  if (g.sgs.size() < nsg) g.sgs.resize(nsg);
  for (size_t k = 0; k < nsg; k++) g.sgs[k].reset();
  g.used = 0;
  g.decls.clear();
  __builtin_memset(g.mem, 0xff, TG_BYTES);  // NaN: threadgroup memory is not initialised
  for (int i = 0; i < n; i++) {
    Lane& l = g.lanes[i];
    l.state = RUN;
    getcontext(&l.ctx);
    l.ctx.uc_stack.ss_sp = g.stacks[i];
    l.ctx.uc_stack.ss_size = STACK;
    l.ctx.uc_link = nullptr;
    makecontext(&l.ctx, (void (*)())trampoline, 1, i);
  }
  while (g.live > 0) {
    bool ran = false;
    for (int i = 0; i < n; i++) {
      if (g.lanes[i].state != RUN) continue;
      ran = true;
      g.cur = i;
      swapcontext(&g.sched, &g.lanes[i].ctx);
    }
    if (ran) continue;
    // Nothing can run: the lanes of a SIMD-group wait at different calls (divergent paths).
    // Complete, per SIMD-group, the call its lowest waiting lane is at, as the GPU runs one
    // path after the other; the others follow on later passes.
    bool resolved = false;
    for (size_t k = 0; k * SIMD < (size_t)n; k++) {
      SimdGroup& s = g.sgs[k];
      if (s.waiting == 0) continue;
      for (int l = 0; l < SIMD; l++)
        if (s.site[l] != 0) {
          simd_complete((int)k, s.site[l]);
          resolved = true;
          break;
        }
    }
    if (!resolved) fail("deadlock: threads wait at threadgroup_barrier that others never reach");
  }
}
}  // namespace ks

namespace metal {
inline void threadgroup_barrier(mem_flags) { ks::tg_barrier(); }
inline void simdgroup_barrier(mem_flags, int ks_site = __builtin_LINE()) {
  unsigned m;
  int l;
  const char z = 0;
  ks::collect(&z, 1, ks_site * 4096 + __LINE__, m, l);
}
inline void atomic_thread_fence(mem_flags, memory_order, thread_scope = thread_scope_device) {}

// SIMD-group functions (metal_simdgroup): rendezvous of the lanes that have not returned; a value
// read from a lane that did not take part is NaN bytes.
#define KS_SHUF(NAME, SRC)                                                                    \
  template <class T> inline T NAME(T x, ushort d, int ks_site = __builtin_LINE()) {              \
    static_assert(sizeof(T) <= 64, "SIMD-group value too large");                             \
    unsigned m;                                                                               \
    int lane;                                                                                 \
    auto s = ks::collect(&x, sizeof(T), ks_site * 4096 + __LINE__, m, lane);                                   \
    const int src = (SRC);                                                                    \
    return src == lane ? x : ks::lane_value<T>(s, m, src);                                    \
  }
KS_SHUF(simd_shuffle, int(d))
KS_SHUF(simd_shuffle_xor, lane ^ int(d & 31))
KS_SHUF(simd_shuffle_down, lane + int(d) < 32 ? lane + int(d) : lane)
KS_SHUF(simd_shuffle_up, lane - int(d) >= 0 ? lane - int(d) : lane)
KS_SHUF(simd_shuffle_rotate_down, (lane + int(d)) & 31)
KS_SHUF(simd_shuffle_rotate_up, (lane - int(d)) & 31)
KS_SHUF(simd_broadcast, int(d))
KS_SHUF(quad_shuffle, (lane & ~3) | (int(d) & 3))
KS_SHUF(quad_shuffle_xor, (lane & ~3) | ((lane ^ int(d)) & 3))
KS_SHUF(quad_shuffle_down, (lane & 3) + int(d) < 4 ? lane + int(d) : lane)
KS_SHUF(quad_shuffle_up, (lane & 3) - int(d) >= 0 ? lane - int(d) : lane)
KS_SHUF(quad_broadcast, (lane & ~3) | (int(d) & 3))
#undef KS_SHUF
template <class T> inline T simd_shuffle_and_fill_down(T x, T fill, ushort d, int ks_site = __builtin_LINE()) {
  struct P { T x, f; } p{x, fill};
  unsigned m;
  int lane;
  auto s = ks::collect(&p, sizeof(P), ks_site * 4096 + __LINE__, m, lane);
  const int src = lane + int(d);
  const P q = ks::lane_value<P>(s, m, src < 32 ? src : src - 32);
  return src < 32 ? q.x : q.f;
}
template <class T> inline T simd_shuffle_and_fill_up(T x, T fill, ushort d, int ks_site = __builtin_LINE()) {
  struct P { T x, f; } p{x, fill};
  unsigned m;
  int lane;
  auto s = ks::collect(&p, sizeof(P), ks_site * 4096 + __LINE__, m, lane);
  const int src = lane - int(d);
  const P q = ks::lane_value<P>(s, m, src >= 0 ? src : src + 32);
  return src >= 0 ? q.x : q.f;
}
// Reductions and scans over the lanes that take part (quad_*: over the caller's quad; SCAN 1:
// lanes up to the caller, 2: lanes below it).
template <class T, class F> inline T ks_fold(T x, F f, bool quad, int scan, T ident, int site) {
  static_assert(sizeof(T) <= 64, "SIMD-group value too large");
  unsigned m;
  int lane;
  auto s = ks::collect(&x, sizeof(T), site, m, lane);
  const int lo = quad ? (lane & ~3) : 0, hi = quad ? lo + 4 : 32;
  T acc = ident;
  bool any = false;
  for (int l = lo; l < hi; l++) {
    if ((scan == 1 && l > lane) || (scan == 2 && l >= lane)) break;
    if (!((m >> l) & 1u)) continue;
    T v;
    __builtin_memcpy(&v, s[l], sizeof(T));
    acc = any ? f(acc, v) : v;
    any = true;
  }
  return acc;
}
#define KS_RED(NAME, OP, IDENT, QUAD, SCAN)                                                   \
  template <class T> inline T NAME(T x, int ks_site = __builtin_LINE()) {                     \
    return ks_fold(x, [](T a, T b) { return T(OP); }, QUAD, SCAN, T(IDENT), ks_site * 4096 + __LINE__);       \
  }
KS_RED(simd_sum, a + b, 0, false, 0)
KS_RED(simd_product, a * b, 1, false, 0)
KS_RED(simd_max, metal::max(a, b), 0, false, 0)
KS_RED(simd_min, metal::min(a, b), 0, false, 0)
KS_RED(simd_and, a & b, 0, false, 0)
KS_RED(simd_or, a | b, 0, false, 0)
KS_RED(simd_xor, a ^ b, 0, false, 0)
KS_RED(simd_prefix_inclusive_sum, a + b, 0, false, 1)
KS_RED(simd_prefix_exclusive_sum, a + b, 0, false, 2)
KS_RED(simd_prefix_inclusive_product, a * b, 1, false, 1)
KS_RED(simd_prefix_exclusive_product, a * b, 1, false, 2)
KS_RED(quad_sum, a + b, 0, true, 0)
KS_RED(quad_max, metal::max(a, b), 0, true, 0)
KS_RED(quad_min, metal::min(a, b), 0, true, 0)
KS_RED(quad_prefix_inclusive_sum, a + b, 0, true, 1)
KS_RED(quad_prefix_exclusive_sum, a + b, 0, true, 2)
#undef KS_RED
template <class T> inline T simd_broadcast_first(T x, int ks_site = __builtin_LINE()) {
  unsigned m;
  int lane;
  auto s = ks::collect(&x, sizeof(T), ks_site * 4096 + __LINE__, m, lane);
  return ks::lane_value<T>(s, m, __builtin_ctz(m));
}
struct simd_vote {
  typedef uint64_t vote_t;
  vote_t bits = 0;
  explicit operator vote_t() const { return bits; }
  bool all() const { return bits == 0xffffffffull; }
  bool any() const { return bits != 0; }
};
inline simd_vote simd_ballot(bool b, int ks_site = __builtin_LINE()) {
  unsigned m;
  int lane;
  const char c = b;
  auto s = ks::collect(&c, 1, ks_site * 4096 + __LINE__, m, lane);
  simd_vote v;
  for (int l = 0; l < 32; l++)
    if (((m >> l) & 1u) && s[l][0]) v.bits |= 1ull << l;
  return v;
}
inline bool simd_any(bool b, int ks_site = __builtin_LINE()) { return simd_ballot(b, ks_site).bits != 0; }
inline bool simd_all(bool b, int ks_site = __builtin_LINE()) {
  unsigned m;
  int lane;
  const char c = b;
  auto s = ks::collect(&c, 1, ks_site * 4096 + __LINE__, m, lane);
  for (int l = 0; l < 32; l++)
    if (((m >> l) & 1u) && !s[l][0]) return false;
  return true;
}
inline bool simd_is_first(int ks_site = __builtin_LINE()) {
  unsigned m;
  int lane;
  const char c = 0;
  ks::collect(&c, 1, ks_site * 4096 + __LINE__, m, lane);
  return lane == __builtin_ctz(m);
}
#else
inline void threadgroup_barrier(mem_flags) {}
inline void simdgroup_barrier(mem_flags) {}
inline void atomic_thread_fence(mem_flags, memory_order, thread_scope = thread_scope_device) {}

// SIMD-group functions (metal_simdgroup).
#define KS_SIMD1(NAME)                                                                        \
  template <class T> inline T NAME(T x) { return x; }
KS_SIMD1(simd_sum) KS_SIMD1(simd_max) KS_SIMD1(simd_min) KS_SIMD1(simd_product)
KS_SIMD1(simd_and) KS_SIMD1(simd_or) KS_SIMD1(simd_xor)
KS_SIMD1(simd_prefix_inclusive_sum) KS_SIMD1(simd_prefix_exclusive_sum)
KS_SIMD1(simd_prefix_inclusive_product) KS_SIMD1(simd_prefix_exclusive_product)
KS_SIMD1(simd_broadcast_first)
KS_SIMD1(quad_sum) KS_SIMD1(quad_max) KS_SIMD1(quad_min)
KS_SIMD1(quad_prefix_inclusive_sum) KS_SIMD1(quad_prefix_exclusive_sum)
#undef KS_SIMD1
#define KS_SIMD2(NAME)                                                                        \
  template <class T> inline T NAME(T x, ushort) { return x; }
KS_SIMD2(simd_shuffle) KS_SIMD2(simd_shuffle_xor) KS_SIMD2(simd_shuffle_down) KS_SIMD2(simd_shuffle_up)
KS_SIMD2(simd_shuffle_rotate_down) KS_SIMD2(simd_shuffle_rotate_up) KS_SIMD2(simd_broadcast)
KS_SIMD2(quad_shuffle) KS_SIMD2(quad_shuffle_xor) KS_SIMD2(quad_shuffle_down) KS_SIMD2(quad_shuffle_up)
KS_SIMD2(quad_broadcast)
#undef KS_SIMD2
template <class T> inline T simd_shuffle_and_fill_down(T x, T, ushort) { return x; }
template <class T> inline T simd_shuffle_and_fill_up(T x, T, ushort) { return x; }
struct simd_vote {
  typedef uint64_t vote_t;
  vote_t bits = 0;
  explicit operator vote_t() const { return bits; }
  bool all() const { return bits == ~vote_t(0); }
  bool any() const { return bits != 0; }
};
inline simd_vote simd_ballot(bool) { return simd_vote(); }
inline bool simd_any(bool b) { return b; }
inline bool simd_all(bool b) { return b; }
inline bool simd_is_first() { return true; }

#endif  // KS_METAL_EXEC

// Atomics (metal_atomic).
template <class T> struct atomic {
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
// Read-modify-write: the executor runs every thread on one OS thread, switching only at
// barriers and SIMD-group functions, so plain operations are atomic there.
#define KS_ATOMIC_RMW(NAME, EXPR)                                                             \
  template <class T> inline T NAME(volatile atomic<T>* obj, typename ks_ident<T>::type v, memory_order) { \
    const T old = obj->value;                                                                 \
    obj->value = T(EXPR);                                                                     \
    return old;                                                                               \
  }                                                                                           \
  template <class T> inline T NAME(atomic<T>* obj, typename ks_ident<T>::type v, memory_order) { \
    return NAME((volatile atomic<T>*)obj, v, memory_order_relaxed);                           \
  }
KS_ATOMIC_RMW(atomic_fetch_add_explicit, old + v)
KS_ATOMIC_RMW(atomic_fetch_sub_explicit, old - v)
KS_ATOMIC_RMW(atomic_fetch_and_explicit, old & v)
KS_ATOMIC_RMW(atomic_fetch_or_explicit, old | v)
KS_ATOMIC_RMW(atomic_fetch_xor_explicit, old ^ v)
KS_ATOMIC_RMW(atomic_fetch_min_explicit, v < old ? v : old)
KS_ATOMIC_RMW(atomic_fetch_max_explicit, v > old ? v : old)
KS_ATOMIC_RMW(atomic_exchange_explicit, v)
#undef KS_ATOMIC_RMW
template <class T> inline T atomic_load_explicit(const atomic<T>* obj, memory_order) { return obj->value; }
template <class T> inline T atomic_load_explicit(const volatile atomic<T>* obj, memory_order) { return obj->value; }
template <class T> inline void atomic_store_explicit(atomic<T>* obj, typename ks_ident<T>::type v, memory_order) { obj->value = v; }
template <class T> inline void atomic_store_explicit(volatile atomic<T>* obj, typename ks_ident<T>::type v, memory_order) { obj->value = v; }
template <class T>
inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* obj, T* expected, typename ks_ident<T>::type desired,
                                                  memory_order, memory_order) {
  if (obj->value == *expected) {
    obj->value = desired;
    return true;
  }
  *expected = obj->value;
  return false;
}
template <class T>
inline bool atomic_compare_exchange_weak_explicit(atomic<T>* obj, T* expected, typename ks_ident<T>::type desired,
                                                  memory_order a, memory_order b) {
  return atomic_compare_exchange_weak_explicit((volatile atomic<T>*)obj, expected, desired, a, b);
}

// SIMD-group matrices (metal_simdgroup_matrix). In execution mode every lane holds the whole
// matrix (e[row][col]): each lane loads it whole and computes the products; a store writes the
// lane's share only.
template <class T, int Cols, int Rows> struct simdgroup_matrix {
#ifdef KS_METAL_EXEC
  T e[Rows][Cols];
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T v) {
    for (int r = 0; r < Rows; r++)
      for (int c = 0; c < Cols; c++) e[r][c] = r == c ? v : T(0);
  }
#else
  T e[2];
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T) {}
#endif
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
template <class T, int C, int R> inline simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, C, R> m;
#ifdef KS_METAL_EXEC
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) m.e[r][c] = v;
#else
  (void)v;
#endif
  return m;
}
// matrix_origin is (column, row) of the stored matrix; with transpose_matrix, element (r, c) is
// the stored element (c, r).
template <class T, int C, int R, class U>
inline void simdgroup_load(simdgroup_matrix<T, C, R>& d, const U* src, ulong elements_per_row = C,
                           ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  static_assert(std::is_same<typename std::remove_cv<U>::type, T>::value, "simdgroup_load: element type mismatch");
#ifdef KS_METAL_EXEC
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) {
      const ulong sr = transpose_matrix ? c : r, sc = transpose_matrix ? r : c;
      d.e[r][c] = src[(matrix_origin.y + sr) * elements_per_row + matrix_origin.x + sc];
    }
#else
  (void)d; (void)src; (void)elements_per_row; (void)matrix_origin; (void)transpose_matrix;
#endif
}
template <class T, int C, int R, class U>
inline void simdgroup_store(const simdgroup_matrix<T, C, R>& a, U* dst, ulong elements_per_row = C,
                            ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  static_assert(std::is_same<U, T>::value, "simdgroup_store: element type mismatch");
#ifdef KS_METAL_EXEC
  // Each lane stores only its share (here: row-major elements 2 lane and 2 lane + 1), as on the
  // GPU, so a lane that reads what others stored without a barrier in between sees old data.
  const int lane = ks::G().cur % ks::SIMD, per = (R * C + ks::SIMD - 1) / ks::SIMD;
  for (int e = lane * per; e < (lane + 1) * per && e < R * C; e++) {
    const int r = e / C, c = e % C;
    const ulong sr = transpose_matrix ? c : r, sc = transpose_matrix ? r : c;
    dst[(matrix_origin.y + sr) * elements_per_row + matrix_origin.x + sc] = a.e[r][c];
  }
#else
  (void)a; (void)dst; (void)elements_per_row; (void)matrix_origin; (void)transpose_matrix;
#endif
}
template <class T, class A, class B, int C, int R, int K>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<T, C, R>& d, const simdgroup_matrix<A, K, R>& a,
                                          const simdgroup_matrix<B, C, K>& b, const simdgroup_matrix<T, C, R>& c) {
#ifdef KS_METAL_EXEC
  simdgroup_matrix<T, C, R> t;
  for (int r = 0; r < R; r++)
    for (int j = 0; j < C; j++) {
      float s = float(c.e[r][j]);
      for (int k = 0; k < K; k++) s += float(a.e[r][k]) * float(b.e[k][j]);
      t.e[r][j] = T(s);
    }
  d = t;
#else
  (void)d; (void)a; (void)b; (void)c;
#endif
}
template <class T, class A, class B, int C, int R, int K>
inline void simdgroup_multiply(simdgroup_matrix<T, C, R>& d, const simdgroup_matrix<A, K, R>& a,
                               const simdgroup_matrix<B, C, K>& b) {
#ifdef KS_METAL_EXEC
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<T, C, R>(T(0)));
#else
  (void)d; (void)a; (void)b;
#endif
}

}  // namespace metal

// MLX kernel utilities that MLX puts in scope for metal_kernel bodies
// (mlx/backend/metal/kernels/utils.h): elem_to_loc(element, shape, strides, ndim) is the memory
// offset of a row-major element index in a strided array.
template <class IdxT = int64_t, class E, class S, class T>
inline IdxT elem_to_loc(E elem, const S* shape, const T* strides, int ndim) {
  IdxT loc = 0;
  IdxT e = IdxT(elem);
  for (int i = ndim - 1; i >= 0 && e > 0; --i) {
    loc += (e % IdxT(shape[i])) * IdxT(strides[i]);
    e /= IdxT(shape[i]);
  }
  return loc;
}
// MLX's other overloads (e.g. 3-D elements with two stride arrays) are declared loosely: they type-
// check, and stop an executed kernel with that reason.
template <class IdxT = int64_t, class... A> inline IdxT elem_to_loc(A...) {
#ifdef KS_METAL_EXEC
  ks::fail("this elem_to_loc overload is not modelled by the executor");
#endif
  return IdxT(0);
}

#endif  // KSEARCH_METAL_SHIM_H
