/* The few-row kernels' `block` (`few_rows.c`, `few_rows_float32.c`): their `block_of` called with the row and column
 * counts as constants, so that its loops unroll and the sums stay in registers. With counts known only at run time GCC
 * keeps the sums in memory, a load and a store around every multiply-add: against that code, on a 2-core Zen 5
 * (`python -m bench.few_rows --kernel-source`, with few_rows.c's unrolled final sums), the products ran 1.2-3.3x
 * faster in bfloat16 at 1-32 rows and 1.07-1.7x in float32 at 1-8 rows (AVX-512; built for AVX2, where 16 registers
 * cannot hold the 4 x 4 sums, within 11 % either way at 1-4 rows). The includer defines `block_of`, `OUTPUTS`, `ROWS`
 * and the element type `element`. */
#include <stdint.h>

#if ROWS != 4
#error "block() calls block_of with 1 to 4 rows"
#endif

static inline void block(const element *restrict x, const element *restrict weight, const element *restrict bias,
                         element *restrict out, int64_t row, int rows, int64_t first, int outputs, int64_t in_features,
                         int64_t out_stride)
{
    if (outputs == OUTPUTS) {
        switch (rows) {
        case 1: block_of(x, weight, bias, out, row, 1, first, OUTPUTS, in_features, out_stride); return;
        case 2: block_of(x, weight, bias, out, row, 2, first, OUTPUTS, in_features, out_stride); return;
        case 3: block_of(x, weight, bias, out, row, 3, first, OUTPUTS, in_features, out_stride); return;
        case 4: block_of(x, weight, bias, out, row, 4, first, OUTPUTS, in_features, out_stride); return;
        }
    }
    block_of(x, weight, bias, out, row, rows, first, outputs, in_features, out_stride); /* a last, narrower block */
}
