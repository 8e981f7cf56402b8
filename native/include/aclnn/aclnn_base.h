/* CANN's aclnn base (aclnn_base.h): the argument objects and executor control of the two-phase API. */
#ifndef ACLNN_REMOTE_ACLNN_BASE_H_
#define ACLNN_REMOTE_ACLNN_BASE_H_

#include "aclnn/acl_meta.h"

#ifdef __cplusplus
/* CANN's own sample programs use std::array without including it (their toolchains' headers bring it). */
#include <array>
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Keeps an executor usable for repeated launches until aclDestroyAclOpExecutor (before its first launch). */
ACL_FUNC_VISIBILITY aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor *executor);
ACL_FUNC_VISIBILITY aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor);

#ifdef __cplusplus
}
#endif

#endif /* ACLNN_REMOTE_ACLNN_BASE_H_ */
