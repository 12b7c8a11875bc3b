/* One MoBA decode step on the CPU, float32: the gate over the pooled block keys, the pick of the best candidate
 * blocks and attention over the picked and forced keys, read where they lie in the cache, in one call.
 *
 * Query row r (= batch row * Hq + query head) reads KV run r / group; position p of its sequence is storage row
 * run * step + start + p of k and v (rows of D numbers). Its keys, in order: the picked blocks (in pick order), then
 * the forced ones: the sink blocks [0, lo * bs) and the tail [hi * bs, n) (local blocks and its own block).
 *
 * The arithmetic is the torch path's up to rounding: scores = scale * q.k, softmax over every listed key, out = sum of
 * probs * v; the softmax is taken per segment (max, exp, sum) and the segments' shares rescaled to the row's max,
 * as flash-decoding does. A NaN or inf propagates as there: every listed key is attended, nothing is masked.
 * Built with -fopenmp in a process that has loaded torch: it runs on torch's OpenMP runtime and thread pool. */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_D 256     /* head dims up to this */
#define MAX_GROUP 16  /* query heads per KV head up to this */
#define MAX_PICKS 64  /* gated blocks per row up to this (native.MAX_PICKS) */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* q.k of 8 keys (rows of d numbers, `stride` apart) into out[0..7]: 8 accumulators, then one transposing
 * reduction */
static void dot8(const float *q, const float *k, int64_t d, int64_t stride, float *out) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) {
        __m256 qv = _mm256_loadu_ps(q + c);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * stride + c), acc[j]);
    }
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(out, sums);
    for (; c < d; c++)
        for (int j = 0; j < 8; j++) out[j] += q[c] * k[j * stride + c];
}

/* dot8's arithmetic for one key: the same products, lanes and reduction tree, so equal keys score equally in a run
 * of 8 or alone (ties in the gate are broken by index, never by rounding) */
static float dot1(const float *q, const float *k, int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), acc);
    float l[8];
    _mm256_storeu_ps(l, acc);
    float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    for (; c < d; c++) s += q[c] * k[c];
    return s;
}

/* exp of x <= 0 (a softmax's x - max), 8 at a time: Cephes' expf (range reduction by ln 2, degree-5 polynomial,
 * about 1 ulp); below -87.3 (-inf included) exactly 0, a NaN stays NaN */
static __m256 exp8(__m256 x) {
    const __m256 nan_mask = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    y = _mm256_andnot_ps(under, y);
    return _mm256_blendv_ps(y, x, nan_mask);
}
#endif

/* q.k of one key: dot1 where dot8 runs, else a plain loop */
static float dot(const float *a, const float *b, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
    return dot1(a, b, n);
#else
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
/* acc[0 .. 8T) = sum over j of (p[j] * inv) * v_j[0 .. 8T): T accumulators held in registers over the n rows */
static inline __attribute__((always_inline)) void wsum_lanes(const float *p, float inv, const float *v, int64_t d,
                                                              int64_t n, float *acc, const int T) {
    __m256 a[8];
    for (int t = 0; t < T; t++) a[t] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        __m256 w = _mm256_set1_ps(p[j] * inv);
        for (int t = 0; t < T; t++) a[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + j * d + 8 * t), a[t]);
    }
    for (int t = 0; t < T; t++) _mm256_storeu_ps(acc + 8 * t, a[t]);
}
#endif

/* acc = sum over j of (p[j] * inv) * v_j, n consecutive value rows of d numbers */
static void wsum(const float *p, float inv, const float *v, int64_t d, int64_t n, float *acc) {
#if defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0) {
        for (int64_t c = 0; c < d; c += 64) {
            switch ((d - c < 64 ? d - c : 64) / 8) {
            case 1: wsum_lanes(p, inv, v + c, d, n, acc + c, 1); break;
            case 2: wsum_lanes(p, inv, v + c, d, n, acc + c, 2); break;
            case 3: wsum_lanes(p, inv, v + c, d, n, acc + c, 3); break;
            case 4: wsum_lanes(p, inv, v + c, d, n, acc + c, 4); break;
            case 5: wsum_lanes(p, inv, v + c, d, n, acc + c, 5); break;
            case 6: wsum_lanes(p, inv, v + c, d, n, acc + c, 6); break;
            case 7: wsum_lanes(p, inv, v + c, d, n, acc + c, 7); break;
            default: wsum_lanes(p, inv, v + c, d, n, acc + c, 8); break;
            }
        }
        return;
    }
#endif
    memset(acc, 0, sizeof(float) * d);
    for (int64_t j = 0; j < n; j++) {
        const float w = p[j] * inv;
        for (int64_t c = 0; c < d; c++) acc[c] += w * v[j * d + c];
    }
}

/* the largest of n numbers, or NaN if any is NaN (as torch's max) */
static float max_of(const float *x, int64_t n) {
    float mx = -INFINITY;
    int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 m = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        __m256 x8 = _mm256_loadu_ps(x + j);
        m = _mm256_max_ps(m, x8);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x8, x8, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) return NAN;
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (int c = 0; c < 8; c++) mx = lanes[c] > mx ? lanes[c] : mx;
#endif
    for (; j < n; j++) {
        if (isnan(x[j])) return NAN;
        mx = x[j] > mx ? x[j] : mx;
    }
    return mx;
}

/* x[j] = exp(x[j] - mx) of n numbers; returns their sum */
static float exp_sum(float *x, int64_t n, float mx) {
    int64_t j = 0;
    float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps(), m = _mm256_set1_ps(mx);
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), m));
        _mm256_storeu_ps(x + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int c = 0; c < 8; c++) sum += lanes[c];
#endif
    for (; j < n; j++) { x[j] = expf(x[j] - mx); sum += x[j]; }
    return sum;
}

/* a ranks before b (at indices ia < ib when equal): a NaN first, then larger; -inf counts as -FLT_MAX */
static int ranks_before(float a, float b) {
    if (isnan(a)) return !isnan(b);
    if (isnan(b)) return 0;
    return a > b;
}

/* a row's segment: `len` consecutive sequence positions from `pos`, scored into the row's slots from `slot` */
typedef struct { int64_t pos, len, slot; } segment;

/* a segment the rows of one KV run read: read once for all of its users (row * n_seg + the row's segment index) */
typedef struct { int64_t pos, len, users; int64_t user[MAX_GROUP]; } shared;

/* the n_pick best candidate blocks lo .. hi - 1 by the gate (a NaN first, then larger, the earlier of equal ones),
 * as choose_blocks picks them; then the row's segments: the picks in pick order, the sink blocks, the tail */
static void gate_row(const float *gq, const float *pk, int64_t width, int64_t block_stride, int64_t lo, int64_t hi,
                     int64_t n_pick, int64_t n, int64_t bs, int64_t *best, segment *sg) {
    float best_score[MAX_PICKS];
    int64_t found = 0;
#if defined(__AVX2__) && defined(__FMA__)
    float run[8];
#endif
    for (int64_t j = lo; j < hi; j++) {
#if defined(__AVX2__) && defined(__FMA__)
        if ((j - lo) % 8 == 0 && j + 8 <= hi) dot8(gq, pk + j * block_stride, width, block_stride, run);
        float s = (j - lo) / 8 * 8 + lo + 8 <= hi ? run[(j - lo) % 8] : dot(gq, pk + j * block_stride, width);
#else
        float s = dot(gq, pk + j * block_stride, width);
#endif
        if (s == -INFINITY) s = -3.402823466e38f; /* as the torch path's clamp to the lowest float */
        int64_t at = found; /* after every pick that ranks before it or ties with it */
        while (at > 0 && ranks_before(s, best_score[at - 1])) at--;
        if (at >= n_pick) continue;
        for (int64_t m = found < n_pick ? found : n_pick - 1; m > at; m--) {
            best_score[m] = best_score[m - 1];
            best[m] = best[m - 1];
        }
        best_score[at] = s;
        best[at] = j;
        if (found < n_pick) found++;
    }
    int64_t slot = 0, m = 0;
    for (int64_t i = 0; i < n_pick; i++, m++, slot += bs) {
        sg[m] = (segment){best[i] * bs, bs, slot};
        best[i] -= lo;
    }
    for (int64_t p = 0; p < lo * bs; p += bs, m++, slot += bs) sg[m] = (segment){p, bs, slot};
    for (int64_t p = hi * bs; p < n; p += bs, m++) {
        int64_t len = n - p < bs ? n - p : bs;
        sg[m] = (segment){p, len, slot};
        slot += len;
    }
}

/* a segment's share of its row's softmax: the scores' max m, sum of exp(score - m) and sum of exp(score - m) * v,
 * combined across the row's segments at the end (each rescaled by exp(m - the row's max)) */
static void segment_share(float *sr, const float *vr, int64_t d, int64_t len, float *mx, float *sum, float *acc) {
    *mx = max_of(sr, len);
    if (*mx == -INFINITY) { /* exp(-inf - -inf) would be NaN: the segment adds nothing unless every score is -inf */
        *sum = 0.0f;
        memset(acc, 0, sizeof(float) * d);
        return;
    }
    *sum = exp_sum(sr, len, *mx);
    wsum(sr, 1.0f, vr, d, len, acc);
}

/* On a busy machine the OS deschedules a thread for a time slice (milliseconds, where a step takes a fraction of
 * one), and the step's one wait on its threads then lasts that long. After such a wait the next calls run on the
 * calling thread alone, computing the same (each work item is computed alike on any thread, and the rows' shares
 * are combined in one order), a run of calls that doubles while the waits go on and ends when one does not. */
#define STALL_NS 500000     /* a wait past this (and past the caller's own work) is a descheduled thread */
#define SERIAL_RUN_MIN 64   /* calls */
#define SERIAL_RUN_MAX 4096
static atomic_llong serial_left; /* calls left to run on one thread */
static atomic_llong serial_run;  /* the length of the next such run after a wait (0: the first) */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* the threads a call with n_items work items runs on, `asked` (torch's setting) or one */
static int threads_for(int asked, int64_t n_items) {
#ifndef _OPENMP
    return 1;
#endif
    if (asked <= 1 || n_items <= 1) return 1;
    if (atomic_load(&serial_left) > 0) {
        atomic_fetch_sub(&serial_left, 1);
        return 1;
    }
    return asked;
}

/* after a call on several threads (times: its start, when the caller found no item left, its end): a long wait
 * starts or lengthens a run of one-thread calls, a short one ends it */
static void after_parallel(int64_t start, int64_t caller_done, int64_t end) {
    if (end - caller_done > STALL_NS && end - caller_done > caller_done - start) {
        long long run = atomic_load(&serial_run);
        run = run < SERIAL_RUN_MIN ? SERIAL_RUN_MIN : (2 * run > SERIAL_RUN_MAX ? SERIAL_RUN_MAX : 2 * run);
        atomic_store(&serial_run, run);
        atomic_store(&serial_left, run);
    } else {
        atomic_store(&serial_run, 0);
    }
}

int moba_decode_step(const float *q, const float *gate_q, int64_t rows, int64_t d, int64_t width, int64_t group,
                     const float *pooled, int64_t pooled_run_stride, int64_t pooled_block_stride,
                     const float *k, const float *v, int64_t step, int64_t start, int64_t n, int64_t bs, int64_t lo,
                     int64_t hi, int64_t n_pick, float scale, float *out, int64_t *picks, int threads) {
    if (d > MAX_D || group > MAX_GROUP || n_pick > MAX_PICKS) return 2;
    int64_t runs = rows / group, tail = n - hi * bs;
    int64_t n_seg = n_pick + lo + (tail + bs - 1) / bs;
    int64_t nnz = (n_pick + lo) * bs + tail;
    int64_t per_run = group * n_seg; /* the most distinct segments a run's rows read */
    float *scores = malloc(sizeof(float) * rows * nnz);
    float *partial = malloc(sizeof(float) * rows * n_seg * d);
    float *seg_max = malloc(sizeof(float) * rows * n_seg);
    float *seg_sum = malloc(sizeof(float) * rows * n_seg);
    segment *segs = malloc(sizeof(segment) * rows * n_seg);
    shared *reads = malloc(sizeof(shared) * runs * per_run);
    int64_t *items = malloc(sizeof(int64_t) * runs * per_run);
    int64_t *scratch = picks ? NULL : malloc(sizeof(int64_t) * (rows * n_pick + 1)); /* picks NULL: not asked for */
    if (!scores || !partial || !seg_max || !seg_sum || !segs || !reads || !items || (!picks && !scratch)) {
        free(scores); free(partial); free(seg_max); free(seg_sum); free(segs); free(reads); free(items);
        free(scratch);
        return 1;
    }
    if (!picks) picks = scratch;
    /* each row's picks and segments, then its run's distinct segments (the work items): on the calling thread, so
     * that the one parallel loop below is the step's only wait on other threads (a thread the OS has descheduled
     * stalls every wait by its time slice) */
    int64_t n_items = 0;
    for (int64_t u = 0; u < runs; u++) {
        shared *rd = reads + u * per_run;
        int64_t count = 0;
        for (int64_t r = u * group; r < (u + 1) * group; r++) {
            gate_row(gate_q + r * width, pooled + u * pooled_run_stride, width, pooled_block_stride, lo, hi, n_pick,
                     n, bs, picks + r * n_pick, segs + r * n_seg);
            for (int64_t m = 0; m < n_seg; m++) {
                segment sg = segs[r * n_seg + m];
                int64_t i = 0;
                while (i < count && rd[i].pos != sg.pos) i++;
                if (i == count) rd[count++] = (shared){sg.pos, sg.len, 0, {0}};
                rd[i].user[rd[i].users++] = r * n_seg + m;
            }
        }
        for (int64_t i = 0; i < count; i++) items[n_items++] = u * per_run + i;
    }
    /* each distinct segment's keys and values read once, for every row that reads it: its scores and its share of
     * each of those rows' softmax */
    const int use = threads_for(threads, n_items);
    int64_t start_ns = use > 1 ? now_ns() : 0, caller_done = 0;
#pragma omp parallel num_threads(use)
    {
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t it = 0; it < n_items; it++) {
            const shared *rd = reads + items[it];
            const int64_t offset = ((items[it] / per_run) * step + start + rd->pos) * d;
            const float *kr = k + offset, *vr = v + offset;
            int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
            for (; j + 8 <= rd->len; j += 8) {
                /* the same keys' value rows on their way into L2 (16 floats a cache line) while these are scored: the
                 * segment's values stream from memory beside its keys, not after them */
                for (int64_t c = 0; c < 8 * d; c += 16) _mm_prefetch((const char *)(vr + j * d + c), _MM_HINT_T1);
                for (int64_t i = 0; i < rd->users; i++) {
                    int64_t r = rd->user[i] / n_seg;
                    float *sr = scores + r * nnz + segs[rd->user[i]].slot + j;
                    dot8(q + r * d, kr + j * d, d, d, sr);
                    for (int c = 0; c < 8; c++) sr[c] *= scale;
                }
            }
#endif
            for (; j < rd->len; j++)
                for (int64_t i = 0; i < rd->users; i++) {
                    int64_t r = rd->user[i] / n_seg;
                    scores[r * nnz + segs[rd->user[i]].slot + j] = dot(q + r * d, kr + j * d, d) * scale;
                }
            for (int64_t i = 0; i < rd->users; i++) {
                int64_t user = rd->user[i];
                segment_share(scores + (user / n_seg) * nnz + segs[user].slot, vr, d, rd->len, seg_max + user,
                              seg_sum + user, partial + user * d);
            }
        }
#ifdef _OPENMP
        if (use > 1 && omp_get_thread_num() == 0) caller_done = now_ns(); /* no item left: from here it waits */
#endif
    }
    if (use > 1) after_parallel(start_ns, caller_done, now_ns());
    /* each row's output: its segments' shares rescaled to the row's max (a NaN wins; all -inf gives NaN, as the
     * softmax's exp(-inf - -inf)), summed in its segment order, divided by the softmax's sum */
    for (int64_t r = 0; r < rows; r++) {
        const float row_max = max_of(seg_max + r * n_seg, n_seg);
        float total = 0.0f, *o = out + r * d;
        memset(o, 0, sizeof(float) * d);
        for (int64_t m = r * n_seg; m < (r + 1) * n_seg; m++) {
            const float w = expf(seg_max[m] - row_max);
            total += seg_sum[m] * w;
            for (int64_t c = 0; c < d; c++) o[c] += partial[m * d + c] * w;
        }
        const float inv = 1.0f / total;
        for (int64_t c = 0; c < d; c++) o[c] *= inv;
    }
    free(scores); free(partial); free(seg_max); free(seg_sum); free(segs); free(reads); free(items); free(scratch);
    return 0;
}

/* One new key per run merged into its block's statistics, and the block's pooled key re-derived from them
 * (kernels.pooling.BlockStats: merge_, then pool_into). stats and pooled: the block's rows of `width` numbers, one
 * per run, `*_stride` apart; x: the new keys, rows of d numbers `x_stride` apart. The sums are stats[0, split), the
 * maxima stats[split, width) over the features x ("bound": [x, -x]); count: the block's keys after the merge. */
void moba_block_append(float *stats, int64_t stats_stride, float *pooled, int64_t pooled_stride, const float *x,
                       int64_t x_stride, int64_t runs, int64_t d, int64_t width, int64_t split, int bound,
                       int64_t count) {
    const float divisor = (float)(count > 1 ? count : 1);
    for (int64_t r = 0; r < runs; r++) {
        float *s = stats + r * stats_stride, *p = pooled + r * pooled_stride;
        const float *xr = x + r * x_stride;
        for (int64_t c = 0; c < split; c++) {
            s[c] += xr[c];
            p[c] = s[c] / divisor;
        }
        for (int64_t c = 0; c < width - split; c++) {
            const float f = bound && c >= d ? -xr[c - d] : xr[c];
            const float m = s[split + c];
            s[split + c] = isnan(m) || isnan(f) ? NAN : (f > m ? f : m); /* torch.maximum: a NaN wins */
            p[split + c] = s[split + c];
        }
    }
}
