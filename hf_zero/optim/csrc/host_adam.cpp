// One pass of Adam / AdamW over fp32 host tensors, with the 16-bit cast of the result and the undo copy of the
// pre-step state written in the same pass (hf_zero/optim/host_adam.py builds and calls this; read its docstring).
//
// Why a kernel of our own: the offloaded step is bound by host memory bandwidth. torch's fused CPU kernel reads
// and writes the master and both moments once, but the offload engine then reads the master a second time to
// cast it to bf16/fp16 for the GPU, and a speculative step reads all three a second time, before the update, to
// keep an exact undo copy. Here those reads are the ones the update does anyway.
//
// Why every operation below is spelled out in this order: the result must equal torch._fused_adamw_ /
// torch._fused_adam_ bit for bit (a run must not change when the engine switches kernels), so each element goes
// through the same IEEE-754 float operations, in the same order, as the vectorised body of torch's kernel:
// scalars computed in double and rounded to float once, a true fused multiply-add in exp_avg's lerp, separate
// multiplies and adds elsewhere. This file is compiled with -ffp-contract=off so that our compiler fuses nothing
// on its own; but torch's own build lets its compiler fuse two more spots (measured on torch 2.13: the square
// term of exp_avg_sq, and Adam's L2 term added to the gradient), and another build may not. So those two are
// chosen at run time by `variant` bits, which host_adam.py picks once per process by comparing with the
// installed torch's kernel on probe data. Only whole 16-element blocks are handled here; the caller gives the
// last numel % 16 elements to torch's own kernel, whose scalar tail loop rounds differently from its vector body.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <optional>

#if !defined(CPU_CAPABILITY_AVX512) && !defined(CPU_CAPABILITY_AVX2)
#error "host_adam.cpp is built for AVX2 or AVX-512 only (host_adam.py picks one from /proc/cpuinfo)"
#endif

namespace {

using Vec = at::vec::Vectorized<float>;

// Elements per unit of work handed to a thread: 64 bytes of fp32, so every thread's range starts a multiple of
// 64 bytes into each fp32 tensor (on a cache line, as torch's allocations are 64-byte aligned: no two threads
// write one line, and aligned streaming stores stay aligned) and holds a whole number of vectors of either ISA.
constexpr int64_t kBlock = 16;
static_assert(kBlock % Vec::size() == 0, "a block must hold whole vectors");
// at::parallel_for's grain, in units (32K elements): smaller steps stay on the calling thread and no thread gets
// less, because waking a thread costs more than it saves on less.
constexpr int64_t kGrainBlocks = 2048;

enum class Out16 { kNone, kBF16, kFP16 };

// Where the step's fp32 results go. kInPlace: over param, exp_avg and exp_avg_sq. kBackup: the same, and the values
// from before the step into the three other tensors (a speculative step's undo copy). kOutOfPlace: into the three other
// tensors, the inputs left as they were (a speculative step that is kept by swapping buffers and undone by not swapping:
// 12 bytes an element fewer than kBackup, which writes both).
enum class Mode { kInPlace, kBackup, kOutOfPlace };

// ---- the few operations at::vec does not offer for one vector of floats: bf16 loads, 16-bit stores, streaming
#if defined(CPU_CAPABILITY_AVX512)
using Half = __m256i;  // one vector's worth of 16-bit values

inline Vec load_bf16(const uint16_t* src) {
  // bf16 is the top half of an fp32: widening and shifting left by 16 is the exact conversion
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
}

inline Half to_bf16(const Vec& x) {
  // round to nearest even on the bit pattern, as torch's .to(torch.bfloat16) does; every NaN becomes 0xffff,
  // which is what torch's cast writes (tests/test_host_adam.py checks NaNs, infinities, ties and subnormals)
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0xffff));
  return _mm512_cvtepi32_epi16(rounded);
}

inline Half to_fp16(const Vec& x) {
  // the F16C instruction torch's cast uses: round to nearest even, inf on overflow, NaN payloads kept
  return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

inline void store_half(uint16_t* dst, Half h, bool stream) {
  if (stream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), h);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
  }
}

inline void store_f32(float* dst, const Vec& x, bool stream) {
  if (stream) {
    _mm512_stream_ps(dst, x);
  } else {
    x.store(dst);
  }
}
#else  // AVX2
using Half = __m128i;

inline Vec load_bf16(const uint16_t* src) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
}

inline Half to_bf16(const Vec& x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd), 16);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0xffff), _mm256_castps_si256(nan));
  // every lane is <= 0xffff, so the unsigned saturating pack only narrows
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

inline Half to_fp16(const Vec& x) {
  return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

inline void store_half(uint16_t* dst, Half h, bool stream) {
  if (stream) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), h);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), h);
  }
}

inline void store_f32(float* dst, const Vec& x, bool stream) {
  if (stream) {
    _mm256_stream_ps(dst, x);
  } else {
    x.store(dst);
  }
}
#endif

// The per-step scalars, each computed in double and rounded to float once, as torch's kernel does.
struct Scalars {
  float decay;        // AdamW: 1 - lr * weight_decay
  float wd;           // Adam: weight_decay, added to the gradient as wd * param
  float lerp_coeff;   // exp_avg.lerp_(grad, w), w = 1 - beta1: w when |w| < 0.5, else w - 1
  bool lerp_from_avg; // the lerp's base: exp_avg when |w| < 0.5, else grad
  float beta2;
  float sq_coeff;     // 1 - beta2
  float bc2_sqrt;     // sqrt(1 - beta2**step)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1**step)
  bool has_wd;
  bool adamw;
  bool maximize;
  bool fuse_sq;  // exp_avg_sq = fma(sq_coeff * g, g, exp_avg_sq * beta2), else two roundings
  bool fuse_l2;  // Adam: g = fma(param, wd, g), else g + param * wd (the choice may differ under maximize)
};

// Bits of `variant`: which of torch's possibly compiler-fused spots are fused (see the top of this file).
constexpr int64_t kFuseSq = 1;     // exp_avg_sq's square term
constexpr int64_t kFuseL2 = 2;     // Adam's L2 term, maximize=False
constexpr int64_t kFuseL2Max = 4;  // Adam's L2 term, maximize=True

struct Pointers {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  uint16_t* out16;
  float* backup_param;  // kBackup: receives the state before the step; kOutOfPlace: the state after it
  float* backup_avg;
  float* backup_sq;
  bool stream_out16;
  bool stream_backup;
};

template <bool kBf16Grad, Out16 kOut, Mode kMode>
void step_range(const Pointers& t, const Scalars& s, int64_t lo, int64_t hi) {
  const Vec decay(s.decay), wd(s.wd), coeff(s.lerp_coeff), beta2(s.beta2), sq_coeff(s.sq_coeff);
  const Vec bc2_sqrt(s.bc2_sqrt), eps(s.eps), neg_step_size(s.neg_step_size), minus_one(-1.0f);
  for (int64_t i = lo; i < hi; i += Vec::size()) {
    Vec p = Vec::loadu(t.param + i);
    Vec g = kBf16Grad ? load_bf16(static_cast<const uint16_t*>(t.grad) + i)
                      : Vec::loadu(static_cast<const float*>(t.grad) + i);
    Vec m = Vec::loadu(t.exp_avg + i);
    Vec v = Vec::loadu(t.exp_avg_sq + i);
    if constexpr (kMode == Mode::kBackup) {
      store_f32(t.backup_param + i, p, t.stream_backup);
      store_f32(t.backup_avg + i, m, t.stream_backup);
      store_f32(t.backup_sq + i, v, t.stream_backup);
    }
    if (s.maximize) {
      g = g * minus_one;
    }
    if (s.has_wd) {
      if (s.adamw) {
        p = p * decay;
      } else if (s.fuse_l2) {
        g = at::vec::fmadd(p, wd, g);
      } else {
        g = g + p * wd;
      }
    }
    m = at::vec::fmadd(coeff, g - m, s.lerp_from_avg ? m : g);
    if (s.fuse_sq) {
      v = at::vec::fmadd(sq_coeff * g, g, v * beta2);
    } else {
      v = v * beta2 + sq_coeff * g * g;
    }
    const Vec denom = v.sqrt() / bc2_sqrt + eps;
    p = p + neg_step_size * m / denom;
    if constexpr (kMode == Mode::kOutOfPlace) {
      store_f32(t.backup_avg + i, m, t.stream_backup);
      store_f32(t.backup_sq + i, v, t.stream_backup);
      store_f32(t.backup_param + i, p, t.stream_backup);
    } else {
      m.store(t.exp_avg + i);
      v.store(t.exp_avg_sq + i);
      p.store(t.param + i);
    }
    if constexpr (kOut == Out16::kBF16) {
      store_half(t.out16 + i, to_bf16(p), t.stream_out16);
    } else if constexpr (kOut == Out16::kFP16) {
      store_half(t.out16 + i, to_fp16(p), t.stream_out16);
    }
  }
}

template <bool kBf16Grad, Out16 kOut, Mode kMode>
void run(const Pointers& t, const Scalars& s, int64_t n) {
  const bool streams = (kOut != Out16::kNone && t.stream_out16) || (kMode != Mode::kInPlace && t.stream_backup);
  at::parallel_for(0, n / kBlock, kGrainBlocks, [&](int64_t begin, int64_t end) {
    step_range<kBf16Grad, kOut, kMode>(t, s, begin * kBlock, end * kBlock);
    if (streams) {
      _mm_sfence();  // streaming stores are weakly ordered: make them visible before the step returns
    }
  });
}

template <bool kBf16Grad, Out16 kOut>
void dispatch_mode(const Pointers& t, const Scalars& s, int64_t n, Mode mode) {
  switch (mode) {
    case Mode::kInPlace:
      return run<kBf16Grad, kOut, Mode::kInPlace>(t, s, n);
    case Mode::kBackup:
      return run<kBf16Grad, kOut, Mode::kBackup>(t, s, n);
    case Mode::kOutOfPlace:
      return run<kBf16Grad, kOut, Mode::kOutOfPlace>(t, s, n);
  }
}

template <bool kBf16Grad>
void dispatch_out(const Pointers& t, const Scalars& s, int64_t n, Out16 out, Mode mode) {
  switch (out) {
    case Out16::kNone:
      return dispatch_mode<kBf16Grad, Out16::kNone>(t, s, n, mode);
    case Out16::kBF16:
      return dispatch_mode<kBf16Grad, Out16::kBF16>(t, s, n, mode);
    case Out16::kFP16:
      return dispatch_mode<kBf16Grad, Out16::kFP16>(t, s, n, mode);
  }
}

bool aligned(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 64 == 0;
}

void check_fp32(const at::Tensor& x, int64_t n, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() >= n,
              "host_adam: ", what, " must be a contiguous fp32 CPU tensor of at least ", n, " elements");
}

// Steps the first n elements (a multiple of 16) of the tensors in place, or, with out_of_place, into the three backup
// tensors (Mode above). step is the count after this step's increment (torch reads state_step as float: so does
// this); variant: kFuse* bits; stream_ok lets 64-byte aligned out16 and backup tensors be written with streaming
// stores.
void host_adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out16,
                    const std::optional<at::Tensor>& backup_param, const std::optional<at::Tensor>& backup_avg,
                    const std::optional<at::Tensor>& backup_sq, int64_t n, double step, double lr, double beta1,
                    double beta2, double eps, double weight_decay, bool adamw, bool maximize, int64_t variant,
                    bool stream_ok, bool out_of_place) {
  TORCH_CHECK(n >= 0 && n % kBlock == 0, "host_adam: n must be a multiple of ", kBlock, ", got ", n);
  check_fp32(param, n, "param");
  check_fp32(exp_avg, n, "exp_avg");
  check_fp32(exp_avg_sq, n, "exp_avg_sq");
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.numel() >= n &&
                  (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16),
              "host_adam: grad must be a contiguous fp32 or bf16 CPU tensor of at least ", n, " elements");
  const bool backup = backup_param.has_value();
  TORCH_CHECK(backup == backup_avg.has_value() && backup == backup_sq.has_value(),
              "host_adam: the backup is three tensors or none");
  TORCH_CHECK(backup || !out_of_place, "host_adam: out_of_place needs the three tensors the results go to");
  const Mode mode = !backup ? Mode::kInPlace : out_of_place ? Mode::kOutOfPlace : Mode::kBackup;
  Out16 out = Out16::kNone;
  Pointers t{param.data_ptr<float>(), grad.data_ptr(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
             nullptr, nullptr, nullptr, nullptr, false, false};
  if (out16.has_value()) {
    const at::Tensor& o = *out16;
    TORCH_CHECK(o.device().is_cpu() && o.is_contiguous() && o.numel() >= n &&
                    (o.scalar_type() == at::kBFloat16 || o.scalar_type() == at::kHalf),
                "host_adam: out16 must be a contiguous bf16 or fp16 CPU tensor of at least ", n, " elements");
    out = o.scalar_type() == at::kBFloat16 ? Out16::kBF16 : Out16::kFP16;
    t.out16 = static_cast<uint16_t*>(o.data_ptr());
    t.stream_out16 = stream_ok && aligned(t.out16);
  }
  if (backup) {
    check_fp32(*backup_param, n, "backup[0]");
    check_fp32(*backup_avg, n, "backup[1]");
    check_fp32(*backup_sq, n, "backup[2]");
    t.backup_param = backup_param->data_ptr<float>();
    t.backup_avg = backup_avg->data_ptr<float>();
    t.backup_sq = backup_sq->data_ptr<float>();
    t.stream_backup = stream_ok && aligned(t.backup_param) && aligned(t.backup_avg) && aligned(t.backup_sq);
  }
  if (n == 0) {
    return;
  }

  const double count = static_cast<double>(static_cast<float>(step));
  const double bias_correction1 = 1 - std::pow(beta1, count);
  const double bias_correction2 = 1 - std::pow(beta2, count);
  const double step_size = lr / bias_correction1;
  Scalars s{};
  s.decay = static_cast<float>(1 - lr * weight_decay);
  s.wd = static_cast<float>(weight_decay);
  const float w = static_cast<float>(1 - beta1);
  s.lerp_from_avg = std::abs(w) < 0.5f;
  s.lerp_coeff = s.lerp_from_avg ? w : w - 1.0f;
  s.beta2 = static_cast<float>(beta2);
  s.sq_coeff = static_cast<float>(1 - beta2);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-step_size);
  s.has_wd = weight_decay != 0;
  s.adamw = adamw;
  s.maximize = maximize;
  s.fuse_sq = (variant & kFuseSq) != 0;
  s.fuse_l2 = (variant & (maximize ? kFuseL2Max : kFuseL2)) != 0;

  if (grad.scalar_type() == at::kBFloat16) {
    dispatch_out<true>(t, s, n, out, mode);
  } else {
    dispatch_out<false>(t, s, n, out, mode);
  }
}

}  // namespace

TORCH_LIBRARY(hf_zero_host_adam, m) {
  m.def("step", &host_adam_step);
}
