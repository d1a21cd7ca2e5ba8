/* A decode step's quantized GEMVs with no Python between them, as the C step runs them: SmolLM2-135M's
 * 30 layers of Q4_1 QKV, O, gate/up and down, then the Q8_0 head, each weight in its own memory (on huge
 * pages, as the runner's are), in order; the kernel builds given on the command line alternate pass by
 * pass in one process. M (environment): the vectors a call takes. Built and run by
 * `python scripts/ab_cpu_kernels.py --kernel gemv-step --variant A --variant B`; the weights' bytes are
 * arbitrary (the headers' float16 scales kept finite), which does not change the time. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
typedef int (*gemv_t)(const float *, const unsigned char *, float *, long, long, long);
typedef long (*rb_t)(long, long);
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static int cmp(const void *a, const void *b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc, char **argv) {
    int nv = argc - 1;
    if (nv < 1 || nv > 8) { fprintf(stderr, "usage: ab_gemv_step LIB.so... (1 to 8)\n"); return 2; } long M = atol(getenv("M") ? getenv("M") : "1"), passes = atol(getenv("PASSES") ? getenv("PASSES") : "60");
    gemv_t q41[8], q80[8]; rb_t rb = 0;
    dlopen("libm.so.6", RTLD_NOW | RTLD_GLOBAL);  /* the builds take expf from the process, as Python's has it */
    for (int v = 0; v < nv; v++) {
        void *h = dlopen(argv[v + 1], RTLD_NOW | RTLD_LOCAL);
        if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
        q41[v] = (gemv_t)dlsym(h, "gemv_q4_1"); q80[v] = (gemv_t)dlsym(h, "gemv_q8_0"); rb = (rb_t)dlsym(h, "cpu_kernels_quant_row_bytes");
    }
    long shapes[4][2] = {{960,576},{576,576},{3072,576},{576,1536}};
    long nw = 121, Ns[121], Ks[121], types[121], offs[122]; offs[0] = 0;
    for (long i = 0; i < nw; i++) {
        if (i < 120) { Ns[i] = shapes[i % 4][0]; Ks[i] = shapes[i % 4][1]; types[i] = 4; }
        else { Ns[i] = 49152; Ks[i] = 576; types[i] = 5; }
        offs[i + 1] = offs[i] + ((Ns[i] * rb(types[i], Ks[i]) + 4095) / 4096) * 4096;
    }
    size_t tot = ((offs[nw] + (2 << 20)) / (2 << 20)) * (2 << 20);
    unsigned char *w = aligned_alloc(2 << 20, tot); madvise(w, tot, MADV_HUGEPAGE);
    for (size_t i = 0; i < tot; i++) w[i] = (unsigned char)((i * 2654435761u) >> 13) & 0x3b;  /* float16 headers finite */
    static float x[8 * 4096], y[8 * 65536];
    for (int i = 0; i < 8 * 4096; i++) x[i] = (i % 7) - 3;
    double *t = calloc(nv * passes, sizeof(double));
    for (int p = 0; p < passes + 2; p++)
        for (int v = 0; v < nv; v++) {
            double t0 = now();
            for (long i = 0; i < nw; i++) (types[i] == 4 ? q41[v] : q80[v])(x, w + offs[i], y, M, Ns[i], Ks[i]);
            if (p >= 2) t[v * passes + p - 2] = now() - t0;
        }
    double base = 0;
    for (int v = 0; v < nv; v++) {
        qsort(t + v * passes, passes, sizeof(double), cmp);
        double med = t[v * passes + passes / 2], best = t[v * passes];
        if (v == 0) base = med;
        printf("  %-40s best %6.2f ms  median %6.2f ms (%5.1f GB/s)  %.3fx the first\n", argv[v + 1], best * 1e3, med * 1e3, offs[nw] / med / 1e9, base / med);
    }
}
