// libnnopbase: the argument objects (aclTensor, arrays). They only describe: nothing here talks to the server.
#include <algorithm>
#include <cstdint>
#include <new>

#include "objects.h"

namespace {

// Bytes per element of the dtypes a scalar can hold (0: none).
size_t element_size(aclDataType type)
{
    switch (type) {
    case ACL_BOOL: case ACL_INT8: case ACL_UINT8:
        return 1;
    case ACL_FLOAT16: case ACL_BF16: case ACL_INT16: case ACL_UINT16:
        return 2;
    case ACL_FLOAT: case ACL_INT32: case ACL_UINT32:
        return 4;
    case ACL_DOUBLE: case ACL_INT64: case ACL_UINT64: case ACL_COMPLEX64:
        return 8;
    case ACL_COMPLEX128:
        return 16;
    default:
        return 0;
    }
}

// A copy the caller owns (CANN's getters hand out new[]'d arrays), and its length.
aclnnStatus copy_out(const std::vector<int64_t> &values, int64_t **out, uint64_t *count)
{
    *count = values.size();
    *out = new (std::nothrow) int64_t[values.empty() ? 1 : values.size()];
    if (!*out) return ACLNN_ERR_INNER_NULLPTR;
    std::copy(values.begin(), values.end(), *out);
    return ACLNN_SUCCESS;
}

template <typename Array>
aclnnStatus array_size(const Array *array, uint64_t *size)
{
    if (!array || !size) return ACLNN_ERR_PARAM_NULLPTR;
    *size = array->values.size();
    return ACLNN_SUCCESS;
}

}  // namespace

extern "C" {

aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum, aclDataType dataType, const int64_t *stride,
                           int64_t offset, aclFormat format, const int64_t *storageDims, uint64_t storageDimsNum,
                           void *tensorData)
{
    if ((viewDimsNum && !viewDims) || (storageDimsNum && !storageDims) || viewDimsNum > 64 || storageDimsNum > 64) {
        return nullptr;  // what the server would refuse anyway, and nothing to copy from
    }
    auto *tensor = new (std::nothrow) aclTensor;
    if (!tensor) return nullptr;
    tensor->view_dims.assign(viewDims, viewDims + viewDimsNum);
    tensor->storage_dims.assign(storageDims, storageDims + storageDimsNum);
    if (stride) {
        tensor->strides.assign(stride, stride + viewDimsNum);
    } else {  // contiguous, as CANN assumes without strides
        tensor->strides.assign(viewDimsNum, 1);
        // A product past int64 stays at its limit (no signed overflow): the server refuses such a tensor.
        for (int64_t i = static_cast<int64_t>(viewDimsNum) - 2; i >= 0; i--)
            if (__builtin_mul_overflow(tensor->strides[i + 1], viewDims[i + 1], &tensor->strides[i]))
                tensor->strides[i] = INT64_MAX;
    }
    tensor->offset = offset;
    tensor->data_type = dataType;
    tensor->format = format;
    tensor->data = tensorData;
    return tensor;
}

aclIntArray *aclCreateIntArray(const int64_t *value, uint64_t size)
{
    if (size && !value) return nullptr;
    auto *array = new (std::nothrow) aclIntArray;
    if (array) array->values.assign(value, value + size);
    return array;
}

aclFloatArray *aclCreateFloatArray(const float *value, uint64_t size)
{
    if (size && !value) return nullptr;
    auto *array = new (std::nothrow) aclFloatArray;
    if (array) array->values.assign(value, value + size);
    return array;
}

aclBoolArray *aclCreateBoolArray(const bool *value, uint64_t size)
{
    if (size && !value) return nullptr;
    auto *array = new (std::nothrow) aclBoolArray;
    if (array) array->values.assign(value, value + size);
    return array;
}

aclScalar *aclCreateScalar(void *value, aclDataType dataType)
{
    size_t size = element_size(dataType);
    if (!value || !size) return nullptr;
    auto *scalar = new (std::nothrow) aclScalar;
    if (!scalar) return nullptr;
    scalar->data_type = dataType;
    scalar->bytes.assign(static_cast<unsigned char *>(value), static_cast<unsigned char *>(value) + size);
    return scalar;
}

aclnnStatus aclDestroyScalar(const aclScalar *scalar)
{
    delete scalar;
    return ACLNN_SUCCESS;
}

aclnnStatus aclGetViewShape(const aclTensor *tensor, int64_t **viewDims, uint64_t *viewDimsNum)
{
    if (!tensor || !viewDims || !viewDimsNum) return ACLNN_ERR_PARAM_NULLPTR;
    return copy_out(tensor->view_dims, viewDims, viewDimsNum);
}

aclnnStatus aclGetStorageShape(const aclTensor *tensor, int64_t **storageDims, uint64_t *storageDimsNum)
{
    if (!tensor || !storageDims || !storageDimsNum) return ACLNN_ERR_PARAM_NULLPTR;
    return copy_out(tensor->storage_dims, storageDims, storageDimsNum);
}

aclnnStatus aclGetViewStrides(const aclTensor *tensor, int64_t **stridesValue, uint64_t *stridesNum)
{
    if (!tensor || !stridesValue || !stridesNum) return ACLNN_ERR_PARAM_NULLPTR;
    return copy_out(tensor->strides, stridesValue, stridesNum);
}

aclnnStatus aclGetViewOffset(const aclTensor *tensor, int64_t *offset)
{
    if (!tensor || !offset) return ACLNN_ERR_PARAM_NULLPTR;
    *offset = tensor->offset;
    return ACLNN_SUCCESS;
}

aclnnStatus aclGetFormat(const aclTensor *tensor, aclFormat *format)
{
    if (!tensor || !format) return ACLNN_ERR_PARAM_NULLPTR;
    *format = tensor->format;
    return ACLNN_SUCCESS;
}

aclnnStatus aclGetDataType(const aclTensor *tensor, aclDataType *dataType)
{
    if (!tensor || !dataType) return ACLNN_ERR_PARAM_NULLPTR;
    *dataType = tensor->data_type;
    return ACLNN_SUCCESS;
}

aclnnStatus aclGetIntArraySize(const aclIntArray *array, uint64_t *size) { return array_size(array, size); }

aclnnStatus aclGetFloatArraySize(const aclFloatArray *array, uint64_t *size) { return array_size(array, size); }

aclnnStatus aclGetBoolArraySize(const aclBoolArray *array, uint64_t *size) { return array_size(array, size); }

aclnnStatus aclDestroyTensor(const aclTensor *tensor)
{
    delete tensor;  // a call already queued keeps what it sent: the server has its own copy
    return ACLNN_SUCCESS;
}

aclnnStatus aclDestroyIntArray(const aclIntArray *array)
{
    delete array;
    return ACLNN_SUCCESS;
}

aclnnStatus aclDestroyFloatArray(const aclFloatArray *array)
{
    delete array;
    return ACLNN_SUCCESS;
}

aclnnStatus aclDestroyBoolArray(const aclBoolArray *array)
{
    delete array;
    return ACLNN_SUCCESS;
}

}  // extern "C"
