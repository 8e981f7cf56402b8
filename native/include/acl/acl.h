/* CANN's acl.h for programs that run their operators on a remote aclnn-serve (see docs/native.md). */
#ifndef ACLNN_REMOTE_ACL_H_
#define ACLNN_REMOTE_ACL_H_

#include "acl/acl_base.h"
#include "acl/acl_rt.h"

#endif /* ACLNN_REMOTE_ACL_H_ */
