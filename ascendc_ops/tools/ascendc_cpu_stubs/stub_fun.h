/* Stand-in for the toolkit's tikicpulib `stub_fun.h`: everything is in stub_def.h /
 * stub_generated.h (syntax-only compile; see stub_def.h). */
#ifndef SAO_ASCENDC_STUB_FUN_H
#define SAO_ASCENDC_STUB_FUN_H
#include "stub_def.h"
#endif
