// The argument objects read back through CANN's getters (libnnopbase alone: no server is reached).
// Prints "<what> <values...>" lines, and "<case> <status>" for refusals.
#include <cstdio>

#include "aclnn/aclnn_base.h"

static void print(const char *what, const int64_t *values, uint64_t count)
{
    std::printf("%s", what);
    for (uint64_t i = 0; i < count; i++) std::printf(" %lld", static_cast<long long>(values[i]));
    std::printf("\n");
    delete[] values;  // the getters' arrays are the caller's
}

int main()
{
    int64_t view[3] = {2, 3, 4}, strides[3] = {1, 2, 6}, storage[1] = {30};
    char *fake_device = reinterpret_cast<char *>(0x1000);  // described only, never read
    aclTensor *t = aclCreateTensor(view, 3, ACL_FLOAT16, strides, 5, ACL_FORMAT_NCL, storage, 1, fake_device);
    int64_t *values = nullptr;
    uint64_t count = 0;
    if (aclGetViewShape(t, &values, &count) == ACLNN_SUCCESS) print("view", values, count);
    if (aclGetViewStrides(t, &values, &count) == ACLNN_SUCCESS) print("strides", values, count);
    if (aclGetStorageShape(t, &values, &count) == ACLNN_SUCCESS) print("storage", values, count);
    int64_t offset = -1;
    aclFormat format = ACL_FORMAT_UNDEFINED;
    aclDataType type = ACL_DT_UNDEFINED;
    aclGetViewOffset(t, &offset);
    aclGetFormat(t, &format);
    aclGetDataType(t, &type);
    std::printf("offset %lld\nformat %d\ndtype %d\n", static_cast<long long>(offset), format, type);

    int64_t ints[4] = {7, 8, 9, 10};
    float floats[2] = {0.5f, 1.5f};
    bool bools[3] = {true, false, true};
    aclIntArray *int_array = aclCreateIntArray(ints, 4);
    aclFloatArray *float_array = aclCreateFloatArray(floats, 2);
    aclBoolArray *bool_array = aclCreateBoolArray(bools, 3);
    uint64_t sizes[3] = {0, 0, 0};
    aclGetIntArraySize(int_array, &sizes[0]);
    aclGetFloatArraySize(float_array, &sizes[1]);
    aclGetBoolArraySize(bool_array, &sizes[2]);
    std::printf("array_sizes %llu %llu %llu\n", static_cast<unsigned long long>(sizes[0]),
                static_cast<unsigned long long>(sizes[1]), static_cast<unsigned long long>(sizes[2]));

    double eps = 1e-5;
    aclScalar *scalar = aclCreateScalar(&eps, ACL_DOUBLE);
    std::printf("scalar %d\n", scalar != nullptr);
    std::printf("scalar_of_no_value %d\n", aclCreateScalar(nullptr, ACL_DOUBLE) != nullptr);
    std::printf("scalar_of_a_string %d\n", aclCreateScalar(&eps, ACL_STRING) != nullptr);
    std::printf("null_tensor %d\n", aclGetViewShape(nullptr, &values, &count));
    std::printf("null_out %d\n", aclGetDataType(t, nullptr));
    std::printf("null_array %d\n", aclGetIntArraySize(nullptr, &sizes[0]));

    aclDestroyScalar(scalar);
    aclDestroyTensor(t);
    aclDestroyIntArray(int_array);
    aclDestroyFloatArray(float_array);
    aclDestroyBoolArray(bool_array);
    return 0;
}
