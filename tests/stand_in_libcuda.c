/* A stand-in NVIDIA driver for a host without one: built twice by the tests (conftest.py:
 * build_stand_in_driver), as libcuda.so.1 and as libnvidia-ml.so.1. One device, and every call
 * logged, "<pid> <call>", to the file STAND_IN_CUDA_LOG names. It answers as the driver does
 * where that matters to a process that forks: before cuInit, cuDeviceGetCount says
 * CUDA_ERROR_NOT_INITIALIZED (3), and before nvmlInit, nvmlDeviceGetCount_v2 says
 * NVML_ERROR_UNINITIALIZED (1); cuDriverGetVersion answers without cuInit; cuGetProcAddress finds
 * nothing (CUDA_ERROR_NOT_FOUND), so the CUDA runtime cannot go further. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static int initialised = 0, nvml_initialised = 0;
static void note(const char *name) {
    const char *path = getenv("STAND_IN_CUDA_LOG");
    if (!path) return;
    FILE *f = fopen(path, "a");
    if (f) { fprintf(f, "%d %s\n", (int)getpid(), name); fclose(f); }
}
int cuInit(unsigned int flags) { note("cuInit"); initialised = 1; return 0; }
int cuDriverGetVersion(int *v) { note("cuDriverGetVersion"); *v = 13000; return 0; }
int cuDeviceGetCount(int *n) { note("cuDeviceGetCount"); if (!initialised) return 3; *n = 1; return 0; }
int cuGetProcAddress(const char *s, void **p, int v, unsigned long long f) { note("cuGetProcAddress"); if (p) *p = 0; return 500; }
int cuGetProcAddress_v2(const char *s, void **p, int v, unsigned long long f, void *st) { note("cuGetProcAddress_v2"); if (p) *p = 0; return 500; }
int nvmlInit_v2(void) { note("nvmlInit_v2"); nvml_initialised = 1; return 0; }
int nvmlInit(void) { note("nvmlInit"); nvml_initialised = 1; return 0; }
int nvmlShutdown(void) { note("nvmlShutdown"); nvml_initialised = 0; return 0; }
int nvmlDeviceGetCount_v2(unsigned int *n) { note("nvmlDeviceGetCount_v2"); if (!nvml_initialised) return 1; *n = 1; return 0; }
int nvmlSystemGetDriverVersion(char *v, unsigned int len) { note("nvmlSystemGetDriverVersion"); if (!nvml_initialised) return 1; strncpy(v, "580.00", len); return 0; }
