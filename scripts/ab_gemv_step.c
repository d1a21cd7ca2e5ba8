/* A decode step's GEMVs with no Python between them, as the C step runs them: SmolLM2-135M's 30 layers
 * of Q4_1 QKV, O, gate/up and down, then the Q8_0 head (or, with BF16=1 in the environment, all of them
 * packed bfloat16 through gemm_packed_bf16; BF16=0,1,...: per build on the command line, so that one
 * library given twice compares the two), each weight in its own memory (on huge pages, as the runner's
 * are), in order; the kernel builds given on the command line alternate pass by pass in one process.
 * M (environment): the vectors a call takes. Built and run by
 * `python scripts/ab_cpu_kernels.py --kernel gemv-step --variant A --variant B`; the weights' bytes are
 * arbitrary (float16 scales and bfloat16 weights kept finite), which does not change the time. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
/* (the last argument, bf16, since 2026-12-04: builds from before take six and ignore it) */
typedef int (*gemv_t)(const float *, const unsigned char *, float *, long, long, long, long);
typedef long (*rb_t)(long, long);
typedef void (*gemm_t)(const float *, const unsigned short *, float *, long, long, long);
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static int cmp(const void *a, const void *b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc, char **argv) {
    int nv = argc - 1;
    if (nv < 1 || nv > 8) { fprintf(stderr, "usage: ab_gemv_step LIB.so... (1 to 8)\n"); return 2; } long M = atol(getenv("M") ? getenv("M") : "1"), passes = atol(getenv("PASSES") ? getenv("PASSES") : "60");
    int bf16[8] = {0}, any_bf16 = 0;
    const char *flags = getenv("BF16") ? getenv("BF16") : "0";
    for (int v = 0; v < nv; v++) {
        bf16[v] = atoi(flags) != 0, any_bf16 |= bf16[v];
        if (strchr(flags, ',')) flags = strchr(flags, ',') + 1;  /* else the one flag holds for every build */
    }
    /* LAYERS (environment, 1 to 30): how many layers' weights the 30 layers' calls read, in turn
     * (fewer: the weights stay in the caches; the GB/s printed counts the bytes of the calls) */
    const long layers = getenv("LAYERS") ? atol(getenv("LAYERS")) : 30;
    if (layers < 1 || layers > 30) { fprintf(stderr, "LAYERS is 1 to 30\n"); return 2; }
    gemv_t q41[8], q80[8]; gemm_t gemm[8]; rb_t rb = 0;
    dlopen("libm.so.6", RTLD_NOW | RTLD_GLOBAL);  /* the builds take expf from the process, as Python's has it */
    for (int v = 0; v < nv; v++) {
        void *h = dlopen(argv[v + 1], RTLD_NOW | RTLD_LOCAL);
        if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
        q41[v] = (gemv_t)dlsym(h, "gemv_q4_1"); q80[v] = (gemv_t)dlsym(h, "gemv_q8_0"); rb = (rb_t)dlsym(h, "cpu_kernels_quant_row_bytes");
        gemm[v] = (gemm_t)dlsym(h, "gemm_packed_bf16");
    }
    long shapes[4][2] = {{960,576},{576,576},{3072,576},{576,1536}};
    long nw = 121, Ns[121], Ks[121], types[121], offs[122], bytes[2] = {0, 0}; offs[0] = 0;
    for (long i = 0; i < nw; i++) {
        if (i < 120) { Ns[i] = shapes[i % 4][0]; Ks[i] = shapes[i % 4][1]; types[i] = 4; }
        else { Ns[i] = 49152; Ks[i] = 576; types[i] = 5; }
        bytes[0] += Ns[i] * rb(types[i], Ks[i]), bytes[1] += Ns[i] * 2 * Ks[i];
        offs[i + 1] = offs[i] + ((Ns[i] * (any_bf16 ? 2 * Ks[i] : rb(types[i], Ks[i])) + 4095) / 4096) * 4096;
    }
    size_t tot = ((offs[nw] + (2 << 20)) / (2 << 20)) * (2 << 20);
    unsigned char *w = aligned_alloc(2 << 20, tot); madvise(w, tot, MADV_HUGEPAGE);
    for (size_t i = 0; i < tot; i++)  /* float16 headers finite; bfloat16 weights within 2^-8 .. 2 */
        w[i] = any_bf16 && i % 2 ? 0x3c : (unsigned char)((i * 2654435761u) >> 13) & 0x3b;
    if (M > 256) { fprintf(stderr, "M is at most 256\n"); return 2; }
    static float x[256 * 4096], y[256 * 65536];
    for (int i = 0; i < 256 * 4096; i++) x[i] = (i % 7) - 3;
    double *t = calloc(nv * passes, sizeof(double));
    for (int p = 0; p < passes + 2; p++)
        for (int v = 0; v < nv; v++) {
            double t0 = now();
            for (long i = 0; i < nw; i++) {
                const long o = i < 120 ? offs[i % (4 * layers)] : offs[i];
                if (bf16[v]) gemm[v](x, (const unsigned short *)(w + o), y, M, Ns[i], Ks[i]);
                else (types[i] == 4 ? q41[v] : q80[v])(x, w + o, y, M, Ns[i], Ks[i], 1);
            }
            if (p >= 2) t[v * passes + p - 2] = now() - t0;
        }
    double base = 0;
    for (int v = 0; v < nv; v++) {
        qsort(t + v * passes, passes, sizeof(double), cmp);
        double med = t[v * passes + passes / 2], best = t[v * passes];
        if (v == 0) base = med;
        printf("  %-40s %s best %6.2f ms  median %6.2f ms (%5.1f GB/s)  %.3fx the first\n", argv[v + 1],
               bf16[v] ? "bf16" : "q4_1", best * 1e3, med * 1e3, bytes[bf16[v]] / med / 1e9, base / med);
    }
}
