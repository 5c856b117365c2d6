/* Bfloat16 <-> float32 for the native kernels: a bfloat16 is the high half of a float32's bits. */
#ifndef LLMQ_BFLOAT16_H
#define LLMQ_BFLOAT16_H
#include <stdint.h>

static inline float bf16_to_float(uint16_t value)
{
    union {
        uint32_t bits;
        float value;
    } wide = {.bits = (uint32_t)value << 16};
    return wide.value;
}

#endif
