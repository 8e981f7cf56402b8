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

/* aclnnStatus values (CANN's); the server answers with the first five */
static const int ACLNN_SUCCESS = 0;
static const int ACLNN_ERR_PARAM_NULLPTR = 161001;
static const int ACLNN_ERR_PARAM_INVALID = 161002;
static const int ACLNN_ERR_RUNTIME_ERROR = 361001;
static const int ACLNN_ERR_INNER = 561000;
static const int ACLNN_ERR_INNER_INFERSHAPE_ERROR = 561001;
static const int ACLNN_ERR_INNER_TILING_ERROR = 561002;
static const int ACLNN_ERR_INNER_FIND_KERNEL_ERROR = 561003;
static const int ACLNN_ERR_INNER_CREATE_EXECUTOR = 561101;
static const int ACLNN_ERR_INNER_NOT_TRANS_EXECUTOR = 561102;
static const int ACLNN_ERR_INNER_NULLPTR = 561103;
static const int ACLNN_ERR_INNER_WRONG_ATTR_INFO_SIZE = 561104;

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

/* A scalar holds one value of dataType, copied from *value (no served operator takes one). */
ACL_FUNC_VISIBILITY aclScalar *aclCreateScalar(void *value, aclDataType dataType);
ACL_FUNC_VISIBILITY aclnnStatus aclDestroyScalar(const aclScalar *scalar);

/* What a tensor or array describes; the dims and strides arrays are new[]'d: the caller delete[]s them. */
ACL_FUNC_VISIBILITY aclnnStatus aclGetViewShape(const aclTensor *tensor, int64_t **viewDims, uint64_t *viewDimsNum);
ACL_FUNC_VISIBILITY aclnnStatus aclGetStorageShape(const aclTensor *tensor, int64_t **storageDims,
                                                   uint64_t *storageDimsNum);
ACL_FUNC_VISIBILITY aclnnStatus aclGetViewStrides(const aclTensor *tensor, int64_t **stridesValue, uint64_t *stridesNum);
ACL_FUNC_VISIBILITY aclnnStatus aclGetViewOffset(const aclTensor *tensor, int64_t *offset);
ACL_FUNC_VISIBILITY aclnnStatus aclGetFormat(const aclTensor *tensor, aclFormat *format);
ACL_FUNC_VISIBILITY aclnnStatus aclGetDataType(const aclTensor *tensor, aclDataType *dataType);
ACL_FUNC_VISIBILITY aclnnStatus aclGetIntArraySize(const aclIntArray *array, uint64_t *size);
ACL_FUNC_VISIBILITY aclnnStatus aclGetFloatArraySize(const aclFloatArray *array, uint64_t *size);
ACL_FUNC_VISIBILITY aclnnStatus aclGetBoolArraySize(const aclBoolArray *array, uint64_t *size);

#ifdef __cplusplus
}
#endif

#endif /* ACLNN_REMOTE_ACL_META_H_ */
