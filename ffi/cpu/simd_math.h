// Lets GCC vectorize the activation loops' expf (activations.h) through glibc's libmvec (_ZGVbN4v_expf and
// kin, accurate to a few ulp, NaN and infinities as expf has them). glibc's math.h declares those vector
// variants only under -ffast-math, which would also let the compiler drop NaN propagation and reorder
// sums; here expf alone is declared SIMD (with -fopenmp-simd, CMakeLists.txt), and each loop says with
// `#pragma omp simd` what it allows. Without this the loops run one scalar expf per element: at the CPU's
// small shapes a fifth of the MLP's time.
#pragma once

#include <cmath>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__)
extern "C" {
#pragma omp declare simd notinbranch
float expf(float);
}
#endif
