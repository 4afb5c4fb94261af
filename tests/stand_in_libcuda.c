/* A stand-in NVIDIA driver (libcuda.so.1) for a host without one: one device, and every call
 * logged to the file STAND_IN_CUDA_LOG names. It answers as the driver does where that matters
 * to a process that forks: before cuInit, cuDeviceGetCount says CUDA_ERROR_NOT_INITIALIZED (3);
 * cuDriverGetVersion answers without cuInit; cuGetProcAddress finds nothing (CUDA_ERROR_NOT_FOUND),
 * so the CUDA runtime cannot go further. tests/test_warm.py builds it with gcc. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static int initialised = 0;
static void note(const char *name) {
    const char *path = getenv("STAND_IN_CUDA_LOG");
    if (!path) return;
    FILE *f = fopen(path, "a");
    if (f) { fprintf(f, "%s\n", name); fclose(f); }
}
int cuInit(unsigned int flags) { note("cuInit"); initialised = 1; return 0; }
int cuDriverGetVersion(int *v) { note("cuDriverGetVersion"); *v = 13000; return 0; }
int cuDeviceGetCount(int *n) { note("cuDeviceGetCount"); if (!initialised) return 3; *n = 1; return 0; }
int cuGetProcAddress(const char *s, void **p, int v, unsigned long long f) { note("cuGetProcAddress"); if (p) *p = 0; return 500; }
int cuGetProcAddress_v2(const char *s, void **p, int v, unsigned long long f, void *st) { note("cuGetProcAddress_v2"); if (p) *p = 0; return 500; }
