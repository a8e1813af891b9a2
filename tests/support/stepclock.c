/* A wall clock that the fault matrix can step, for the processes it starts (LD_PRELOAD), never
 * the machine's.
 *
 * The real time plus an offset in seconds read from the file named by STEPCLOCK_FILE (a whole
 * number, "+300" or "-300"), read again at most once a second: clock_gettime() of the
 * CLOCK_REALTIME clocks, gettimeofday() and time(). The monotonic clocks and every sleep are left
 * alone, as a step of the wall clock (NTP, `date -s`) leaves them.
 *
 * Why not libfaketime: Debian's 0.9.10, told to leave the monotonic clock alone
 * (FAKETIME_DONT_FAKE_MONOTONIC=1), fails every clock_nanosleep() on CLOCK_MONOTONIC with an
 * absolute deadline (EINVAL: Python's time.sleep()); without it, the monotonic clock steps with the
 * wall clock, which no real step does.
 *
 * Built by tests.support.stepclock with the C compiler that builds llama-server. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

typedef int (*clock_gettime_t)(clockid_t, struct timespec *);

static clock_gettime_t real_clock_gettime;
static char offset_file[4096];
static _Atomic long long offset_seconds;
static _Atomic long long read_at_ns = -1; /* CLOCK_MONOTONIC of the last read, in ns */

__attribute__((constructor)) static void stepclock_init(void) {
    real_clock_gettime = (clock_gettime_t)dlsym(RTLD_NEXT, "clock_gettime");
    const char *path = getenv("STEPCLOCK_FILE");
    if (path != NULL && strlen(path) < sizeof(offset_file)) {
        strcpy(offset_file, path);
    }
}

/* The offset, read again when the last read is a second old. No allocation (open and read
 * only): clock_gettime() may be called from anywhere. A file that cannot be read keeps the last
 * offset. */
static long long current_offset(void) {
    struct timespec now;
    if (offset_file[0] == '\0' || real_clock_gettime(CLOCK_MONOTONIC, &now) != 0) {
        return atomic_load(&offset_seconds);
    }
    long long at = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
    long long last = atomic_load(&read_at_ns);
    if (last >= 0 && at - last < 1000000000LL) {
        return atomic_load(&offset_seconds);
    }
    atomic_store(&read_at_ns, at);
    int fd = open(offset_file, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        char text[64];
        ssize_t got = read(fd, text, sizeof(text) - 1);
        close(fd);
        if (got > 0) {
            text[got] = '\0';
            char *end;
            long long seconds = strtoll(text, &end, 10);
            if (end != text) {
                atomic_store(&offset_seconds, seconds);
            }
        }
    }
    return atomic_load(&offset_seconds);
}

int clock_gettime(clockid_t clock, struct timespec *tp) {
    if (real_clock_gettime == NULL) {
        real_clock_gettime = (clock_gettime_t)dlsym(RTLD_NEXT, "clock_gettime");
    }
    int rc = real_clock_gettime(clock, tp);
    if (rc == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) {
        tp->tv_sec += current_offset();
    }
    return rc;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    (void)tz;
    struct timespec now;
    int rc = clock_gettime(CLOCK_REALTIME, &now);
    if (rc == 0 && tv != NULL) {
        tv->tv_sec = now.tv_sec;
        tv->tv_usec = now.tv_nsec / 1000;
    }
    return rc;
}

time_t time(time_t *out) {
    struct timespec now;
    if (clock_gettime(CLOCK_REALTIME, &now) != 0) {
        return (time_t)-1;
    }
    if (out != NULL) {
        *out = now.tv_sec;
    }
    return now.tv_sec;
}
