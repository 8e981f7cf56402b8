// CHECK(expr): the test programs' error handling. A nonzero status prints where, what and CANN's
// last error message (aclGetRecentErrMsg), and returns 1 from the calling function.
#pragma once

#include <cstdio>

#include "acl/acl.h"

#define CHECK(expr)                                                                                    \
    do {                                                                                               \
        long long rc_ = (expr);                                                                        \
        if (rc_ != 0) {                                                                                \
            const char *msg_ = aclGetRecentErrMsg();                                                   \
            std::fprintf(stderr, "%s:%d %s -> %lld: %s\n", __FILE__, __LINE__, #expr, rc_, msg_ ? msg_ : ""); \
            return 1;                                                                                  \
        }                                                                                              \
    } while (0)
