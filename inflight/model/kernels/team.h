/* Where the calling thread stands in its OpenMP team (PyTorch's pool, see paged_attention.c):
 * its index and the team's size; 0 and 1 built without OpenMP. */
#ifndef INFLIGHT_TEAM_H
#define INFLIGHT_TEAM_H
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline int64_t team_thread(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int64_t team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}
#endif
