// ksearch Metal shim: lets a C++17 compiler (clang++ or g++) syntax- and type-check Metal
// Shading Language kernels on Linux, where no Metal compiler exists.
//
// It models what kernels use: address-space qualifiers (erased), attributes (ignored by the
// compiler, `-w`), scalar and vector types, math, SIMD-group, barrier, atomic and
// simdgroup_matrix functions. It is a checker, not an emulator: bodies are stubs. Known gaps:
// vector swizzles beyond .x/.y/.z/.w/.r/.g/.b/.a (e.g. `.xy`), textures, and address-space
// mismatches (device vs threadgroup pointers are not told apart).
// Names and signatures follow Apple's Metal Shading Language Specification.
#ifndef KSEARCH_METAL_SHIM_H
#define KSEARCH_METAL_SHIM_H

#include <cstddef>
#include <cstdint>
#include <type_traits>

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
// and converts back on assignment, which is enough for type checking.
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
#undef KS_SMALL_FLOAT
typedef half float16_t;
typedef bfloat bfloat16_t;

template <class T> struct ks_is_scalar
    : std::integral_constant<bool, std::is_arithmetic<T>::value || std::is_same<T, half>::value ||
                                       std::is_same<T, bfloat>::value> {};
template <class T> struct ks_ident { typedef T type; };

// Vectors.
template <class T, int N> struct vec;
#define KS_VEC_INDEX                                                                          \
  T& operator[](int i) { return (&x)[i]; }                                                    \
  const T& operator[](int i) const { return (&x)[i]; }
template <class T> struct vec<T, 2> {
  T x, y;
  vec() = default;
  constexpr vec(T s) : x(s), y(s) {}
  constexpr vec(T a, T b) : x(a), y(b) {}
  template <class U> explicit vec(const vec<U, 2>& o) : x(T(o.x)), y(T(o.y)) {}
  T& r() { return x; }
  KS_VEC_INDEX
};
template <class T> struct vec<T, 3> {
  T x, y, z;
  vec() = default;
  constexpr vec(T s) : x(s), y(s), z(s) {}
  constexpr vec(T a, T b, T c) : x(a), y(b), z(c) {}
  vec(const vec<T, 2>& a, T c) : x(a.x), y(a.y), z(c) {}
  vec(T a, const vec<T, 2>& b) : x(a), y(b.x), z(b.y) {}
  template <class U> explicit vec(const vec<U, 3>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  KS_VEC_INDEX
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
  KS_VEC_INDEX
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
#undef KS_VEC_OP
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

// Atomics (metal_atomic).
template <class T> struct atomic {
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
#define KS_ATOMIC_RMW(NAME)                                                                   \
  template <class T> inline T NAME(volatile atomic<T>* obj, typename ks_ident<T>::type, memory_order) { return obj->value; } \
  template <class T> inline T NAME(atomic<T>* obj, typename ks_ident<T>::type, memory_order) { return obj->value; }
KS_ATOMIC_RMW(atomic_fetch_add_explicit)
KS_ATOMIC_RMW(atomic_fetch_sub_explicit)
KS_ATOMIC_RMW(atomic_fetch_and_explicit)
KS_ATOMIC_RMW(atomic_fetch_or_explicit)
KS_ATOMIC_RMW(atomic_fetch_xor_explicit)
KS_ATOMIC_RMW(atomic_fetch_min_explicit)
KS_ATOMIC_RMW(atomic_fetch_max_explicit)
KS_ATOMIC_RMW(atomic_exchange_explicit)
#undef KS_ATOMIC_RMW
template <class T> inline T atomic_load_explicit(const atomic<T>* obj, memory_order) { return obj->value; }
template <class T> inline T atomic_load_explicit(const volatile atomic<T>* obj, memory_order) { return obj->value; }
template <class T> inline void atomic_store_explicit(atomic<T>* obj, typename ks_ident<T>::type v, memory_order) { obj->value = v; }
template <class T> inline void atomic_store_explicit(volatile atomic<T>* obj, typename ks_ident<T>::type v, memory_order) { obj->value = v; }
template <class T>
inline bool atomic_compare_exchange_weak_explicit(atomic<T>* obj, T* expected, typename ks_ident<T>::type desired,
                                                  memory_order, memory_order) {
  (void)obj; (void)expected; (void)desired;
  return true;
}
template <class T>
inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* obj, T* expected, typename ks_ident<T>::type desired,
                                                  memory_order, memory_order) {
  (void)obj; (void)expected; (void)desired;
  return true;
}

// SIMD-group matrices (metal_simdgroup_matrix).
template <class T, int Cols, int Rows> struct simdgroup_matrix {
  T e[2];
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T) {}
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
template <class T, int C, int R> inline simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T v) {
  return simdgroup_matrix<T, C, R>(v);
}
template <class T, int C, int R, class U>
inline void simdgroup_load(simdgroup_matrix<T, C, R>& d, const U* src, ulong elements_per_row = C,
                           ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  static_assert(std::is_same<typename std::remove_cv<U>::type, T>::value, "simdgroup_load: element type mismatch");
  (void)d; (void)src; (void)elements_per_row; (void)matrix_origin; (void)transpose_matrix;
}
template <class T, int C, int R, class U>
inline void simdgroup_store(const simdgroup_matrix<T, C, R>& a, U* dst, ulong elements_per_row = C,
                            ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  static_assert(std::is_same<U, T>::value, "simdgroup_store: element type mismatch");
  (void)a; (void)dst; (void)elements_per_row; (void)matrix_origin; (void)transpose_matrix;
}
template <class T, class A, class B, int C, int R, int K>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<T, C, R>& d, const simdgroup_matrix<A, K, R>& a,
                                          const simdgroup_matrix<B, C, K>& b, const simdgroup_matrix<T, C, R>& c) {
  (void)d; (void)a; (void)b; (void)c;
}
template <class T, class A, class B, int C, int R, int K>
inline void simdgroup_multiply(simdgroup_matrix<T, C, R>& d, const simdgroup_matrix<A, K, R>& a,
                               const simdgroup_matrix<B, C, K>& b) {
  (void)d; (void)a; (void)b;
}

}  // namespace metal

// MLX kernel utilities that MLX puts in scope for metal_kernel bodies
// (mlx/backend/metal/kernels/utils.h); declared loosely.
template <class IdxT = int64_t, class... A> inline IdxT elem_to_loc(A...) { return IdxT(0); }

#endif  // KSEARCH_METAL_SHIM_H
