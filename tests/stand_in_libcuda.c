/* A stand-in NVIDIA driver for a host without one: built twice by the tests (conftest.py:
 * build_stand_in_driver), as libcuda.so.1 and as libnvidia-ml.so.1. Every call is logged,
 * "<pid> <call>", to the file STAND_IN_CUDA_LOG names. It answers as the driver does where that
 * matters to a process that forks: before cuInit, cuDeviceGetCount says
 * CUDA_ERROR_NOT_INITIALIZED (3), and before nvmlInit, nvmlDeviceGetCount_v2 says
 * NVML_ERROR_UNINITIALIZED (1); cuDriverGetVersion answers without cuInit; cuGetProcAddress finds
 * nothing (CUDA_ERROR_NOT_FOUND), so the CUDA runtime cannot go further.
 * It shows STAND_IN_GPUS devices (none by default: the CUDA runtime could not use one), a driver
 * STAND_IN_DRIVER_VERSION (580.00) that supports CUDA STAND_IN_CUDA_VERSION (13000: 13.0). With
 * STAND_IN_NVML_INIT set, nvmlInit answers that code instead of success: 999, NVML_ERROR_UNKNOWN,
 * is what a container whose GPUs are not passed through (or were lost) gets, "Failed to
 * initialize NVML: Unknown Error"; cuInit then fails too, CUDA_ERROR_UNKNOWN (999).
 * Each device, found by its UUID ("GPU-..."; NVML_ERROR_NOT_FOUND, 6, for one that does not start
 * so), runs STAND_IN_GPU_PROCESSES compute processes, listed as NVML lists them: asked with no room,
 * NVML_ERROR_INSUFFICIENT_SIZE (7) and the count, or success when there are none; asked with room,
 * each process's pid, memory and instance ids (nvmlProcessInfo_v2_t, which _v3 also uses). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static int initialised = 0, nvml_initialised = 0;
static int env_int(const char *name) { const char *v = getenv(name); return v ? atoi(v) : 0; }
static void note(const char *name) {
    const char *path = getenv("STAND_IN_CUDA_LOG");
    if (!path) return;
    FILE *f = fopen(path, "a");
    if (f) { fprintf(f, "%d %s\n", (int)getpid(), name); fclose(f); }
}
int cuInit(unsigned int flags) { note("cuInit"); if (env_int("STAND_IN_NVML_INIT")) return 999; initialised = 1; return 0; }
int cuDriverGetVersion(int *v) { note("cuDriverGetVersion"); *v = getenv("STAND_IN_CUDA_VERSION") ? env_int("STAND_IN_CUDA_VERSION") : 13000; return 0; }
int cuDeviceGetCount(int *n) { note("cuDeviceGetCount"); if (!initialised) return 3; *n = env_int("STAND_IN_GPUS"); return 0; }
int cuGetProcAddress(const char *s, void **p, int v, unsigned long long f) { note("cuGetProcAddress"); if (p) *p = 0; return 500; }
int cuGetProcAddress_v2(const char *s, void **p, int v, unsigned long long f, void *st) { note("cuGetProcAddress_v2"); if (p) *p = 0; return 500; }
static int nvml_init(const char *name) {
    note(name);
    if (env_int("STAND_IN_NVML_INIT")) return env_int("STAND_IN_NVML_INIT");
    nvml_initialised = 1;
    return 0;
}
int nvmlInit_v2(void) { return nvml_init("nvmlInit_v2"); }
int nvmlInit(void) { return nvml_init("nvmlInit"); }
int nvmlInitWithFlags(unsigned int flags) { return nvml_init("nvmlInitWithFlags"); }
int nvmlShutdown(void) { note("nvmlShutdown"); nvml_initialised = 0; return 0; }
int nvmlDeviceGetCount_v2(unsigned int *n) { note("nvmlDeviceGetCount_v2"); if (!nvml_initialised) return 1; *n = env_int("STAND_IN_GPUS"); return 0; }
int nvmlSystemGetDriverVersion(char *v, unsigned int len) { note("nvmlSystemGetDriverVersion"); if (!nvml_initialised) return 1; strncpy(v, getenv("STAND_IN_DRIVER_VERSION") ? getenv("STAND_IN_DRIVER_VERSION") : "580.00", len); return 0; }
typedef struct { unsigned int pid; unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId; } process_info;
int nvmlDeviceGetHandleByUUID(const char *uuid, void **device) {
    note("nvmlDeviceGetHandleByUUID");
    if (!nvml_initialised) return 1;
    if (strncmp(uuid, "GPU-", 4) != 0) return 6;
    *device = (void *)0x1;
    return 0;
}
int nvmlDeviceGetComputeRunningProcesses_v3(void *device, unsigned int *count, process_info *infos) {
    note("nvmlDeviceGetComputeRunningProcesses_v3");
    if (!nvml_initialised) return 1;
    unsigned int n = (unsigned int)env_int("STAND_IN_GPU_PROCESSES");
    if (n == 0) { *count = 0; return 0; }
    if (infos == NULL || *count < n) { *count = n; return 7; }
    for (unsigned int i = 0; i < n; i++) {
        infos[i].pid = 4000 + i;
        infos[i].usedGpuMemory = 512ULL << 20;
        infos[i].gpuInstanceId = infos[i].computeInstanceId = 0xFFFFFFFF;
    }
    *count = n;
    return 0;
}
