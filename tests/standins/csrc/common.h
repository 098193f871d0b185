/*
 * What all four stand-in libraries share (cuda.c, cuda_async.c, nccl.c, nccl_async.c): the export
 * marker and the monotonic clock. Each library is one translation unit that includes this (through
 * cuda_common.h or nccl_common.h) after defining _GNU_SOURCE; everything here is static.
 */
#ifndef STANDIN_COMMON_H
#define STANDIN_COMMON_H

#include <errno.h>
#include <stdint.h>
#include <time.h>

/* built with -fvisibility=hidden: only what is marked API is exported */
#define API __attribute__((visibility("default")))

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t t_ns) {
    struct timespec ts = {(time_t)(t_ns / 1000000000ull), (long)(t_ns % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

#endif
