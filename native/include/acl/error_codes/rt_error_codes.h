/* CANN's runtime error codes (error_codes/rt_error_codes.h, which acl_base.h includes), by value. */
#ifndef ACLNN_REMOTE_RT_ERROR_CODES_H_
#define ACLNN_REMOTE_RT_ERROR_CODES_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

static const int32_t ACL_RT_SUCCESS = 0;

/* Refused arguments (1xxxxx). */
static const int32_t ACL_ERROR_RT_PARAM_INVALID = 107000;
static const int32_t ACL_ERROR_RT_INVALID_DEVICEID = 107001;
static const int32_t ACL_ERROR_RT_CONTEXT_NULL = 107002;
static const int32_t ACL_ERROR_RT_STREAM_CONTEXT = 107003;
static const int32_t ACL_ERROR_RT_MODEL_CONTEXT = 107004;
static const int32_t ACL_ERROR_RT_STREAM_MODEL = 107005;
static const int32_t ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID = 107006;
static const int32_t ACL_ERROR_RT_EVENT_TIMESTAMP_REVERSAL = 107007;
static const int32_t ACL_ERROR_RT_ADDR_UNALIGNED = 107008;
static const int32_t ACL_ERROR_RT_FILE_OPEN = 107009;
static const int32_t ACL_ERROR_RT_FILE_WRITE = 107010;
static const int32_t ACL_ERROR_RT_STREAM_SUBSCRIBE = 107011;
static const int32_t ACL_ERROR_RT_THREAD_SUBSCRIBE = 107012;
static const int32_t ACL_ERROR_RT_GROUP_NOT_SET = 107013;
static const int32_t ACL_ERROR_RT_GROUP_NOT_CREATE = 107014;
static const int32_t ACL_ERROR_RT_STREAM_NO_CB_REG = 107015;
static const int32_t ACL_ERROR_RT_INVALID_MEMORY_TYPE = 107016;
static const int32_t ACL_ERROR_RT_INVALID_HANDLE = 107017;
static const int32_t ACL_ERROR_RT_INVALID_MALLOC_TYPE = 107018;
static const int32_t ACL_ERROR_RT_WAIT_TIMEOUT = 107019;
static const int32_t ACL_ERROR_RT_TASK_TIMEOUT = 107020;

/* Resources (2xxxxx). */
static const int32_t ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000;
static const int32_t ACL_ERROR_RT_MEMORY_ALLOCATION = 207001;
static const int32_t ACL_ERROR_RT_MEMORY_FREE = 207002;
static const int32_t ACL_ERROR_RT_AICORE_OVER_FLOW = 207003;
static const int32_t ACL_ERROR_RT_NO_DEVICE = 207004;
static const int32_t ACL_ERROR_RT_RESOURCE_ALLOC_FAIL = 207005;
static const int32_t ACL_ERROR_RT_NO_PERMISSION = 207006;
static const int32_t ACL_ERROR_RT_NO_EVENT_RESOURCE = 207007;
static const int32_t ACL_ERROR_RT_NO_STREAM_RESOURCE = 207008;
static const int32_t ACL_ERROR_RT_NO_NOTIFY_RESOURCE = 207009;
static const int32_t ACL_ERROR_RT_NO_MODEL_RESOURCE = 207010;
static const int32_t ACL_ERROR_RT_NO_CDQ_RESOURCE = 207011;
static const int32_t ACL_ERROR_RT_OVER_LIMIT = 207012;
static const int32_t ACL_ERROR_RT_QUEUE_EMPTY = 207013;
static const int32_t ACL_ERROR_RT_QUEUE_FULL = 207014;
static const int32_t ACL_ERROR_RT_REPEATED_INIT = 207015;
static const int32_t ACL_ERROR_RT_AIVEC_OVER_FLOW = 207016;

/* Internal failures (5xxxxx). */
static const int32_t ACL_ERROR_RT_INTERNAL_ERROR = 507000;
static const int32_t ACL_ERROR_RT_TS_ERROR = 507001;
static const int32_t ACL_ERROR_RT_STREAM_TASK_FULL = 507002;
static const int32_t ACL_ERROR_RT_STREAM_TASK_EMPTY = 507003;
static const int32_t ACL_ERROR_RT_STREAM_NOT_COMPLETE = 507004;
static const int32_t ACL_ERROR_RT_END_OF_SEQUENCE = 507005;
static const int32_t ACL_ERROR_RT_EVENT_NOT_COMPLETE = 507006;
static const int32_t ACL_ERROR_RT_CONTEXT_RELEASE_ERROR = 507007;
static const int32_t ACL_ERROR_RT_SOC_VERSION = 507008;
static const int32_t ACL_ERROR_RT_TASK_TYPE_NOT_SUPPORT = 507009;
static const int32_t ACL_ERROR_RT_LOST_HEARTBEAT = 507010;
static const int32_t ACL_ERROR_RT_MODEL_EXECUTE = 507011;
static const int32_t ACL_ERROR_RT_REPORT_TIMEOUT = 507012;
static const int32_t ACL_ERROR_RT_SYS_DMA = 507013;
static const int32_t ACL_ERROR_RT_AICORE_TIMEOUT = 507014;
static const int32_t ACL_ERROR_RT_AICORE_EXCEPTION = 507015;
static const int32_t ACL_ERROR_RT_AICORE_TRAP_EXCEPTION = 507016;
static const int32_t ACL_ERROR_RT_AICPU_TIMEOUT = 507017;
static const int32_t ACL_ERROR_RT_AICPU_EXCEPTION = 507018;
static const int32_t ACL_ERROR_RT_STREAM_SYNC_TIMEOUT = 507046;
static const int32_t ACL_ERROR_RT_EVENT_SYNC_TIMEOUT = 507047;
static const int32_t ACL_ERROR_RT_DRV_INTERNAL_ERROR = 507899;
static const int32_t ACL_ERROR_RT_AICPU_INTERNAL_ERROR = 507900;
static const int32_t ACL_ERROR_RT_SOCKET_CLOSE = 507901;

#ifdef __cplusplus
}
#endif

#endif /* ACLNN_REMOTE_RT_ERROR_CODES_H_ */
