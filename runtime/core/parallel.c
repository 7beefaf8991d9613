/* Tasks on several threads: the CPU reference's heads (ref_encode.c) and
 * eval's metrics (eval/metrics.c). */
#include "internal.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <unistd.h>

int kvf_cpu_count(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

typedef struct pool {
    const kvf_tasks *t;
    atomic_int next;     /* the next task to hand out */
    atomic_int err_task; /* the lowest task that failed, n_tasks if none */
    pthread_mutex_t lock;
    int err_rc;
    char err_msg[4096];
} pool;

typedef struct helper { pool *p; int worker; } helper;

/* Take tasks in order until none is left or one has failed (the tasks below a
 * failure are all handed out by then: they finish, and a lower failure among
 * them is the one reported, as one thread going in order would). */
static void take_tasks(pool *p, int worker) {
    const kvf_tasks *t = p->t;
    for (int k; (k = atomic_fetch_add(&p->next, 1)) < t->n_tasks && k < atomic_load(&p->err_task);) {
        int rc = t->run(t->arg, k, worker);
        if (!rc) continue;
        pthread_mutex_lock(&p->lock);
        if (k < atomic_load(&p->err_task)) {
            atomic_store(&p->err_task, k);
            p->err_rc = rc;
            snprintf(p->err_msg, sizeof p->err_msg, "%s", kvf_last_error());
        }
        pthread_mutex_unlock(&p->lock);
    }
}

/* A helper whose setup fails takes no task: the others do its share. */
static void *helper_main(void *arg) {
    helper *h = arg;
    const kvf_tasks *t = h->p->t;
    if (t->setup && t->setup(t->arg, h->worker)) return NULL;
    take_tasks(h->p, h->worker);
    if (t->teardown) t->teardown(t->arg, h->worker);
    return NULL;
}

int kvf_parallel_for(const kvf_tasks *t) {
    if (t->n_tasks <= 0) return KVF_OK;
    int threads = t->threads < t->n_tasks ? t->threads : t->n_tasks;
    if (threads > KVF_MAX_THREADS) threads = KVF_MAX_THREADS;
    if (threads < 1) threads = 1;
    int rc = t->setup ? t->setup(t->arg, 0) : KVF_OK;
    if (rc) return rc;
    pool p = {.t = t};
    atomic_init(&p.next, 0);
    atomic_init(&p.err_task, t->n_tasks);
    pthread_mutex_init(&p.lock, NULL);
    pthread_t tid[KVF_MAX_THREADS];
    helper hs[KVF_MAX_THREADS];
    int n = 0;
    for (; n + 1 < threads; n++) {
        hs[n] = (helper){&p, n + 1};
        if (pthread_create(&tid[n], NULL, helper_main, &hs[n])) break;
    }
    take_tasks(&p, 0);
    for (int i = 0; i < n; i++) pthread_join(tid[i], NULL);
    if (t->teardown) t->teardown(t->arg, 0);
    pthread_mutex_destroy(&p.lock);
    return atomic_load(&p.err_task) < t->n_tasks ? kvf_set_error(p.err_rc, "%s", p.err_msg) : KVF_OK;
}
