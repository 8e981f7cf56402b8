/* CANN's operator argument objects (acl_meta.h): tensors and arrays describing device memory. */
#ifndef ACLNN_REMOTE_ACL_META_H_
#define ACLNN_REMOTE_ACL_META_H_

#include "acl/acl_base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct aclOpExecutor aclOpExecutor;
typedef struct aclTensor aclTensor;
typedef struct aclScalar aclScalar;
typedef struct aclIntArray aclIntArray;
typedef struct aclFloatArray aclFloatArray;
typedef struct aclBoolArray aclBoolArray;
typedef struct aclTensorList aclTensorList;

typedef int32_t aclnnStatus;

/* aclnnStatus values the server answers with (CANN's) */
static const int ACLNN_SUCCESS = 0;
static const int ACLNN_ERR_PARAM_NULLPTR = 161001;
static const int ACLNN_ERR_PARAM_INVALID = 161002;
static const int ACLNN_ERR_RUNTIME_ERROR = 361001;
static const int ACLNN_ERR_INNER = 561000;

/* tensorData is device memory from aclrtMalloc (a pointer into an allocation); strides and offset in elements. */
ACL_FUNC_VISIBILITY aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum, aclDataType dataType,
                                               const int64_t *stride, int64_t offset, aclFormat format,
                                               const int64_t *storageDims, uint64_t storageDimsNum, void *tensorData);
ACL_FUNC_VISIBILITY aclIntArray *aclCreateIntArray(const int64_t *value, uint64_t size);
ACL_FUNC_VISIBILITY aclFloatArray *aclCreateFloatArray(const float *value, uint64_t size);
ACL_FUNC_VISIBILITY aclBoolArray *aclCreateBoolArray(const bool *value, uint64_t size);

ACL_FUNC_VISIBILITY aclnnStatus aclDestroyTensor(const aclTensor *tensor);
ACL_FUNC_VISIBILITY aclnnStatus aclDestroyIntArray(const aclIntArray *array);
ACL_FUNC_VISIBILITY aclnnStatus aclDestroyFloatArray(const aclFloatArray *array);
ACL_FUNC_VISIBILITY aclnnStatus aclDestroyBoolArray(const aclBoolArray *array);

#ifdef __cplusplus
}
#endif

#endif /* ACLNN_REMOTE_ACL_META_H_ */
