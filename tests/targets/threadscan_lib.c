/* A stand-in for a probed library (tests/test_threadscan.py): a call that blocks until released,
 * one that sleeps, and a thread of the library's own that always waits inside it. */
#include <pthread.h>
#include <time.h>

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static volatile int released;

int blocker(void) {
    pthread_mutex_lock(&mu);
    while (!released) pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    return released;
}

int napper(int ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    int r = nanosleep(&ts, 0);
    return r + released; /* not a tail call: napper stays on the stack */
}

static void *worker_main(void *arg) {
    blocker();
    return arg;
}

int start_worker(void) {
    pthread_t t;
    return pthread_create(&t, 0, worker_main, 0);
}
