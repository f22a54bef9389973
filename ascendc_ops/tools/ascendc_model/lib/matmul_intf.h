/* Model of lib/matmul_intf.h: the Matmul API model lives in kernel_operator.h. */
#include "kernel_operator.h"
