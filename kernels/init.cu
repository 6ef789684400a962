// Random initialization of the parameters on the GPU, the twin of llama/twins/init.py's standard_normals
// (which documents the scheme): the value at flat offset g is a pure function of (seed, g), so that any
// slice of the flat parameters (a tensor, a ZeRO shard, a chunk) is drawn on its own.
//
// init_normal: out (n,) fp32 = std * z(seed, start + i), rounded once from float64. One thread per Philox
//   block of 4 offsets (g // 4): it writes the lanes of its block that fall in [start, start + n).
// The transform uses only correctly rounded float64 operations, each named (__dadd_rn, __dmul_rn, ...)
// so that nvcc fuses none into a multiply-add: numpy computes the same bits. The polynomial coefficients
// are the doubles nearest to 1/k and 1/k!, written as Python prints them.
#include "common.cuh"
#include "philox.cuh"

#define INIT_STREAM 0x696E6974u  // "init": the counter's third word
#define LN2 0.6931471805599453
#define SQRT_HALF 0.7071067811865476
#define ANGLE_UNIT 1.4629180792671596e-09  // pi / 2^31

__constant__ double LOG_SERIES[8] = {0.3333333333333333, 0.2, 0.14285714285714285, 0.1111111111111111,
                                     0.09090909090909091, 0.07692307692307693, 0.06666666666666667,
                                     0.058823529411764705};
__constant__ double SIN_SERIES[7] = {-0.16666666666666666, 0.008333333333333333, -0.0001984126984126984,
                                     2.7557319223985893e-06, -2.505210838544172e-08, 1.6059043836821613e-10,
                                     -7.647163731819816e-13};
__constant__ double COS_SERIES[8] = {-0.5, 0.041666666666666664, -0.001388888888888889, 2.48015873015873e-05,
                                     -2.755731922398589e-07, 2.08767569878681e-09, -1.1470745597729725e-11,
                                     4.779477332387385e-14};

// 1 + c[0] x + c[1] x^2 + ... + c[n-1] x^n, innermost first, one rounding per operation.
__device__ __forceinline__ double horner(double x, const double* c, int n) {
    double p = c[n - 1];
    for (int k = n - 2; k >= 0; k--) p = __dadd_rn(__dmul_rn(p, x), c[k]);
    return __dadd_rn(__dmul_rn(p, x), 1.0);
}

// ln u for u = (word + 0.5) / 2^32: u = m 2^(e - 33), m in [sqrt(1/2), sqrt(2)), ln m = 2 s (1 + s^2/3 + ...),
// s = (m - 1) / (m + 1).
__device__ __forceinline__ double log_of_uniform(unsigned word) {
    int exponent;
    double m = frexp((double)(2ull * word + 1ull), &exponent);
    if (m < SQRT_HALF) {
        m = __dmul_rn(m, 2.0);
        exponent -= 1;
    }
    const double s = __ddiv_rn(__dsub_rn(m, 1.0), __dadd_rn(m, 1.0));
    const double log_m = __dmul_rn(__dadd_rn(s, s), horner(__dmul_rn(s, s), LOG_SERIES, 8));
    return __dadd_rn(__dmul_rn((double)(exponent - 33), LN2), log_m);
}

// cos and sin of 2 pi word / 2^32: the quadrant from the top bits, the rest an angle within pi/4 of 0.
__device__ __forceinline__ void cos_sin_of_uniform(unsigned word, double* cos_out, double* sin_out) {
    const unsigned shifted = word + (1u << 29);
    const unsigned quadrant = shifted >> 30;
    const double theta = __dmul_rn((double)((int)(shifted & ((1u << 30) - 1)) - (1 << 29)), ANGLE_UNIT);
    const double theta2 = __dmul_rn(theta, theta);
    const double c = horner(theta2, COS_SERIES, 8), s = __dmul_rn(theta, horner(theta2, SIN_SERIES, 7));
    *cos_out = quadrant == 0 ? c : quadrant == 1 ? -s : quadrant == 2 ? -c : s;
    *sin_out = quadrant == 0 ? s : quadrant == 1 ? c : quadrant == 2 ? -s : -c;
}

// The two normals of Box-Muller from a radius word and an angle word.
__device__ __forceinline__ void box_muller(unsigned radius_word, unsigned angle_word, double* z0, double* z1) {
    const double radius = __dsqrt_rn(__dmul_rn(-2.0, log_of_uniform(radius_word)));
    double c, s;
    cos_sin_of_uniform(angle_word, &c, &s);
    *z0 = __dmul_rn(radius, c);
    *z1 = __dmul_rn(radius, s);
}

extern "C" __global__ void init_normal(float* out, unsigned long long n, unsigned long long start,
                                       unsigned long long seed, double std) {
    const unsigned long long block = start / 4 + (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (4 * block >= start + n) return;
    const uint4 r = philox4x32_10(make_uint4((unsigned)block, (unsigned)(block >> 32), INIT_STREAM, 0u),
                                  make_uint2((unsigned)seed, (unsigned)(seed >> 32)));
    double z[4];
    box_muller(r.x, r.y, &z[0], &z[1]);
    box_muller(r.z, r.w, &z[2], &z[3]);
    for (int lane = 0; lane < 4; lane++) {
        const unsigned long long g = 4 * block + lane;
        if (g >= start && g < start + n) out[g - start] = __double2float_rn(__dmul_rn(z[lane], std));
    }
}
