#!/usr/bin/env python
"""Writes tests/data/ops_nn_ut_cases.json: CANN's own aclnn unit-test cases for the operators served here.

Where the cases come from
-------------------------
Huawei publishes, next to each operator, gtest unit tests of its aclnn API ("op_api" UTs): a test
builds tensor descriptors (shape, dtype, format, optionally strides/offset/storage shape), calls the
operator's GetWorkspaceSize through the UT harness and expects a status (success, 161001 null
parameter, 161002 invalid parameter). The sources read are pinned in SOURCES below:

- hicann/ops-nn, folders norm/ and experimental/norm/ (LayerNorm, LayerNormBackward, BatchNorm,
  BatchNormBackward, GroupNorm, GroupNormBackward, BatchNormElemt, BatchNormElemtBackward,
  BatchNormReduceBackward, BatchNormGatherStatsWithCounts);
- hicann/ops-math, math/reduce_std_with_mean (aclnnBatchNormStats);
- LayerNormGrad has no aclnn API, only graph-level infer-shape UTs; its cases are the hand-written
  table LAYER_NORM_GRAD below (inputs as the UT builds them, outputs as the UT expects them
  inferred, status SUCCESS), checked only for the test names still being in the file.

Every TestGetWorkspaceSize that a test follows with an EXPECT_EQ/ASSERT_EQ (or _NE) on its status
becomes one case; a call no expectation checks is left out, and so is a call to an operator this
service does not serve (the UTs of aclnnLayerNormWithImplMode and aclnnFastBatchNormBackward, other
API entry points, are not read at all). Nothing of the sources' text is kept: each case is the call
in structured form (see tests/test_ops_nn_ut.py for how it is rebuilt) plus where it comes from.

How
---
The test bodies use a small subset of C++: declarations, assignments, range-for and counted for
loops, if/else, the harness's TensorDesc / IntArrayDesc / BoolArrayDesc / OP_API_UT(op, INPUT(...),
OUTPUT(...)) and the gtest EXPECT macros. Each body is rewritten, statement by statement, into Python
and run against stand-ins of the harness that record the calls instead of making them. The SoC a
case assumes is the one the test sets (SocVersionManager, NpuArchManager, SetPlatformSocVersion),
else the one its name starts with, else the harness stub's default (ASCEND910B); tests that branch
on the SoC take the branch of the SoC in effect.

Regenerate (needs git and clones of both repositories holding the pinned commits; a bare clone does):

    python tests/data/make_ops_nn_ut_cases.py --ops-nn PATH/TO/ops-nn --ops-math PATH/TO/ops-math

It prints the number of cases per operator and expectation; the output is deterministic, so a diff of
the JSON shows exactly what a newer commit of the UTs changes (update SOURCES' commits for that).
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import subprocess
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parent / "ops_nn_ut_cases.json"

OPS_NN = ("hicann/ops-nn", "e5c3fa9327ea95ba26d06227e746923580d10921")
OPS_MATH = ("hicann/ops-math", "c41933244c31e44fd496e3bb3212164f8c48c214")

# (repository, commit), UT file path in it. Order is the order of the cases in the JSON.
SOURCES = [
    (OPS_NN, "norm/layer_norm_v4/tests/ut/op_host/op_api/test_aclnn_layer_norm.cpp"),
    (OPS_NN, "norm/layer_norm_v4/tests/ut/op_host/op_api/test_aclnn_fast_layer_norm.cpp"),
    (OPS_NN, "norm/layer_norm_grad_v3/tests/ut/op_host/op_api/test_aclnn_layer_norm_backward.cpp"),
    (OPS_NN, "norm/batch_norm_v3/tests/ut/op_host/op_api/test_aclnn_batchnorm.cpp"),
    (OPS_NN, "norm/batch_norm_grad_v3/tests/ut/op_host/op_api/test_aclnn_batchnorm_backward.cpp"),
    (OPS_NN, "norm/group_norm/tests/ut/op_host/op_api/test_aclnn_group_norm.cpp"),
    (OPS_NN, "experimental/norm/group_norm/tests/ut/op_api/test_aclnn_group_norm.cpp"),
    (OPS_NN, "norm/group_norm_grad/tests/ut/op_host/op_api/test_aclnn_group_norm_backward.cpp"),
    (OPS_NN, "norm/batch_norm_elemt/tests/ut/op_host/op_api/test_aclnn_batchnormelemt.cpp"),
    (OPS_NN, "norm/sync_batch_norm_backward_elemt/tests/ut/op_api/test_aclnn_batchnorm_elemt_backward.cpp"),
    (
        OPS_NN,
        "experimental/norm/sync_batch_norm_backward_elemt/tests/ut/op_api/test_aclnn_batchnorm_elemt_backward.cpp",
    ),
    (OPS_NN, "norm/sync_batch_norm_backward_reduce/tests/ut/op_api/test_aclnn_batchnorm_backward_reduce.cpp"),
    (
        OPS_NN,
        "experimental/norm/sync_batch_norm_backward_reduce/tests/ut/op_api/"
        "test_aclnn_sync_batch_norm_backward_reduce.cpp",
    ),
    (
        OPS_NN,
        "norm/sync_batch_norm_gather_stats_with_counts/tests/ut/op_host/op_api/"
        "test_aclnn_batchnormgatherstatswithcounts.cpp",
    ),
    (OPS_MATH, "math/reduce_std_with_mean/tests/ut/op_api/test_aclnn_batch_norm_stats.cpp"),
]
LAYER_NORM_GRAD_FILE = (OPS_NN, "norm/layer_norm_grad/tests/ut/op_host/test_layer_norm_grad_infershape.cpp")

# ------------------------------------------------------------------------------------------ CANN names

# aclDataType and aclFormat values, by the names the UTs spell (ACL_ / ACL_FORMAT_ prefixes dropped).
DTYPE = {
    "DT_UNDEFINED": -1, "FLOAT": 0, "FLOAT16": 1, "INT8": 2, "INT32": 3, "UINT8": 4, "INT16": 6, "UINT16": 7,
    "UINT32": 8, "INT64": 9, "UINT64": 10, "DOUBLE": 11, "BOOL": 12, "STRING": 13, "COMPLEX64": 16,
    "COMPLEX128": 17, "BF16": 27, "INT4": 29, "UINT1": 30, "COMPLEX32": 33, "HIFLOAT8": 34,
    "FLOAT8_E5M2": 35, "FLOAT8_E4M3FN": 36, "FLOAT8_E8M0": 37, "FLOAT6_E3M2": 38, "FLOAT6_E2M3": 39,
    "FLOAT4_E2M1": 40, "FLOAT4_E1M2": 41,
}  # fmt: skip
FORMAT = {
    "UNDEFINED": -1, "NCHW": 0, "NHWC": 1, "ND": 2, "NC1HWC0": 3, "FRACTAL_Z": 4, "NC1HWC0_C04": 12,
    "HWCN": 16, "NDHWC": 27, "FRACTAL_NZ": 29, "NCDHW": 30, "NDC1HWC0": 32, "FRACTAL_Z_3D": 33, "NC": 35,
    "NCL": 47,
}  # fmt: skip
DTYPE_NAME = {code: name for name, code in DTYPE.items()}
FORMAT_NAME = {code: name for name, code in FORMAT.items()}
EXPECTED = {0: "SUCCESS", 161001: "PARAM_NULLPTR", 161002: "PARAM_INVALID"}
STATUS = {
    "ACL_SUCCESS": 0, "ACLNN_SUCCESS": 0, "ACLNN_ERR_PARAM_NULLPTR": 161001, "ACLNN_ERR_PARAM_INVALID": 161002,
    "ACLNN_ERR_RUNTIME_ERROR": 361001, "ACLNN_ERR_INNER": 561000,
}  # fmt: skip
# NpuArchManager names an architecture; the SoC it stands for in these UTs.
ARCH_SOC = {"DAV_3510": "ASCEND950", "DAV_2201": "ASCEND910B", "DAV_2002": "ASCEND310P"}
STUB_DEFAULT_SOC = "ASCEND910B"  # what the UT harness's platform stub reports unless a test sets one

# The served operators' parameters in CANN's order, inputs then outputs, with their kind:
# t tensor, ia aclIntArray, ba aclBoolArray, d double, i int64, b bool.
SIGNATURES = {
    "aclnnLayerNorm": "input:t normalizedShape:ia weightOptional:t biasOptional:t eps:d"
    " | out:t meanOutOptional:t rstdOutOptional:t",
    "aclnnLayerNormBackward": "gradOut:t input:t normalizedShape:ia mean:t rstd:t weightOptional:t"
    " biasOptional:t outputMask:ba | gradInputOut:t gradWeightOut:t gradBiasOut:t",
    "aclnnBatchNorm": "input:t weight:t bias:t runningMean:t runningVar:t training:b momentum:d eps:d"
    " | output:t saveMean:t saveInvstd:t",
    "aclnnBatchNormBackward": "gradOut:t input:t weight:t runningMean:t runningVar:t saveMean:t saveInvstd:t"
    " training:b eps:d outputMask:ba | gradInput:t gradWeight:t gradBias:t",
    "aclnnGroupNorm": "self:t gamma:t beta:t N:i C:i HxW:i group:i eps:d | out:t meanOut:t rstdOut:t",
    "aclnnGroupNormBackward": "gradOut:t input:t mean:t rstd:t gamma:t N:i C:i HxW:i group:i outputMask:ba"
    " | gradInput:t gradGammaOut:t gradBetaOut:t",
    "aclnnBatchNormStats": "input:t eps:d | mean:t invstd:t",
    "aclnnBatchNormGatherStatsWithCounts": "input:t mean:t invstd:t runningMean:t runningVar:t momentum:d eps:d"
    " counts:t | meanAll:t invstdAll:t",
    "aclnnBatchNormElemt": "input:t weight:t bias:t mean:t invstd:t eps:d | output:t",
    "aclnnBatchNormElemtBackward": "gradOut:t input:t mean:t invstd:t weight:t sumDy:t sumDyXmu:t counter:t"
    " | gradInput:t",
    "aclnnBatchNormReduceBackward": "gradOut:t input:t mean:t invstd:t weight:t inputG:b weightG:b biasG:b"
    " | sumDy:t sumDyXmu:t gradWeight:t gradBias:t",
    "LayerNormGrad": "dy:t x:t variance:t mean:t gamma:t output_mask:ba | pd_x:t pd_gamma:t pd_beta:t",
}


def _signature(text: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    inputs, outputs = text.split("|")
    return [tuple(p.split(":")) for p in inputs.split()], [tuple(p.split(":")) for p in outputs.split()]


SIGNATURE = {op: _signature(text) for op, text in SIGNATURES.items()}

# LayerNormGrad's infer-shape UTs (graph level: no OP_API_UT to read). Per test: dy/x shape,
# variance/mean shape, gamma shape, and the dtypes of x, of the statistics and of gamma; outputs
# pd_x like x, pd_gamma/pd_beta like gamma (what each test expects inferred); output_mask null.
# The file's test_5 (unknown rank -2) has no counterpart as a concrete call and is left out.
LAYER_NORM_GRAD = [
    ("layer_norm_grad_infershape_test_0", [2, 4, 6, 4], [2, 4], [4], ("FLOAT16", "FLOAT16", "FLOAT16")),
    ("layer_norm_grad_infershape_test_1", [2, 4, 6, 4], [2, 4, 1, 1], [4], ("FLOAT16", "FLOAT16", "FLOAT16")),
    ("layer_norm_grad_infershape_test_2", [2, 4, 6, 4], [2, 4, 1, 1], [6, 4], ("FLOAT16", "FLOAT16", "FLOAT16")),
    ("layer_norm_grad_infershape_test_3", [2, 4, 6, 4], [2, 4, 6, 1], [6, 4], ("FLOAT16", "FLOAT16", "FLOAT16")),
    ("layer_norm_grad_infershape_test_4", [], [], [], ("FLOAT16", "FLOAT16", "FLOAT16")),
    ("LayerNormGrad_InferDtype_case", [2, 3, 4], [2, 3, 1], [4], ("FLOAT16", "FLOAT", "FLOAT")),
]

# ------------------------------------------------------------------------------ the harness, recording


class TensorDesc:
    """The UT harness's tensor description: view shape, dtype, format, strides, offset, storage shape."""

    def __init__(self, dims=None, dtype=0, fmt=0, strides=(), offset=0, storage=()):
        if isinstance(dims, TensorDesc):  # TensorDesc t(other): a copy
            self.__dict__.update(copy.deepcopy(dims.__dict__))
            return
        self.dims = [int(d) for d in dims]
        self.dtype, self.fmt = int(dtype), int(fmt)
        self.strides, self.offset, self.storage = [int(s) for s in strides], int(offset), [int(d) for d in storage]

    # Value ranges, values and precision hints matter to the harness's data, not to GetWorkspaceSize.
    def ValueRange(self, *_):
        return self

    Value = Precision = ValidCount = ValueFile = ValueRange

    def ViewDims(self, dims):
        self.dims = [int(d) for d in dims]
        return self

    def Format(self, fmt):
        self.fmt = int(fmt)
        return self

    def as_json(self) -> dict:
        desc = {"shape": self.dims, "dtype": DTYPE_NAME[self.dtype], "format": FORMAT_NAME[self.fmt]}
        # Only what the test sets: strides default to contiguous, offset to 0, storage to the view's shape.
        if self.strides:
            desc["strides"] = self.strides
        if self.offset:
            desc["offset"] = self.offset
        if self.storage:
            desc["storage_shape"] = self.storage
        return desc


class IntArrayDesc(list):
    def __init__(self, values=()):
        super().__init__(int(v) for v in values)


class BoolArrayDesc(list):
    def __init__(self, values=()):
        super().__init__(bool(v) for v in values)


class Recorder:
    """One test's run: the SoC in effect, the calls made, and which of them an expectation checks."""

    def __init__(self):
        self.soc, self.soc_set = STUB_DEFAULT_SOC, None
        self.calls: list[dict] = []
        self.checked: list[tuple[dict, str]] = []

    def set_soc(self, soc: str) -> None:
        self.soc = self.soc_set = soc


REC = Recorder()


def _value(kind: str, value, name: str):
    """A UT argument as the JSON value of a parameter of `kind`."""
    if value is None:
        return None
    if kind == "t":
        if not isinstance(value, TensorDesc):
            raise TypeError(f"{name}: a tensor parameter given {value!r}")
        return value.as_json()
    if kind == "ia":
        return {"int_array": [int(v) for v in value]}
    if kind == "ba":
        return {"bool_array": [bool(v) for v in value]}
    return {"d": float, "i": int, "b": bool}[kind](value)


class OpApiUt:
    """OP_API_UT(op, INPUT(...), OUTPUT(...)): TestGetWorkspaceSize records the call it would make."""

    def __init__(self, op, inputs, outputs, *_):
        self.op, self.inputs, self.outputs = op, inputs, outputs

    def TestGetWorkspaceSize(self, *_):
        call = {"op": self.op, "soc": REC.soc, "params": None}
        REC.calls.append(call)
        if self.op in SIGNATURE:
            ins, outs = SIGNATURE[self.op]
            if (len(self.inputs), len(self.outputs)) != (len(ins), len(outs)):
                raise ValueError(
                    f"{self.op}: {len(self.inputs)}/{len(self.outputs)} arguments, expected {len(ins)}/{len(outs)}"
                )
            pairs = list(zip(ins, self.inputs)) + list(zip(outs, self.outputs))
            call["params"] = {name: _value(kind, v, name) for (name, kind), v in pairs}
        return call  # what the generated code holds as the status, for the EXPECT that follows

    TestGetWorkspaceSizeWithNNopbaseInner = TestGetWorkspaceSize

    def TestPrecision(self):
        pass


def _expect(negated: bool, status, expected) -> None:
    """EXPECT_EQ/EXPECT_NE(status, constant): checks the status of the latest call."""
    if not REC.calls:
        raise ValueError("an expectation before any call")
    if negated:
        if expected != 0:
            raise ValueError(f"EXPECT_NE against status {expected}: no class for it")
        cls = "NOT_SUCCESS"
    elif expected in EXPECTED:
        cls = EXPECTED[expected]
    else:
        raise ValueError(f"expected status {expected}: not a class this data file knows")
    REC.checked.append((REC.calls[-1], cls))


def _harness_names() -> dict:
    names = {f"ACL_{k}": v for k, v in DTYPE.items() if k != "DT_UNDEFINED"}
    names["ACL_DT_UNDEFINED"] = -1
    names.update({f"ACL_FORMAT_{k}": v for k, v in FORMAT.items()})
    names["ACL_FRACTAL_Z_3D"] = FORMAT["FRACTAL_Z_3D"]
    names.update(STATUS)
    names.update(
        TensorDesc=TensorDesc,
        IntArrayDesc=IntArrayDesc,
        BoolArrayDesc=BoolArrayDesc,
        OP_API_UT=OpApiUt,
        INPUT=lambda *a: a,
        OUTPUT=lambda *a: a,
        _expect=_expect,
        _soc=lambda: REC.soc,
        _dup=lambda v: copy.deepcopy(v) if isinstance(v, TensorDesc) else v,
        SocVersionManager=REC.set_soc,
        SetPlatformSocVersion=REC.set_soc,
        NpuArchManager=lambda arch: REC.set_soc(ARCH_SOC.get(arch, arch)),
    )
    return names


# ----------------------------------------------------------------------------- C++ subset -> Python


def _without_comments(src: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", src, flags=re.S))


def _closing(text: str, at: int) -> int:
    """Index of the bracket closing the one at `at`."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    opening, closing, depth = text[at], pairs[text[at]], 0
    for i in range(at, len(text)):
        if text[i] == opening:
            depth += 1
        elif text[i] == closing:
            depth -= 1
            if not depth:
                return i
    raise ValueError(f"no closing {closing} for the one at {at}")


def tests_of(src: str):
    """(test name, body text) of each TEST/TEST_F in a UT file."""
    src = _without_comments(src)
    for m in re.finditer(r"\bTEST(?:_F)?\s*\(\s*\w+\s*,\s*(\w+)\s*\)\s*\{", src):
        brace = m.end() - 1
        yield m.group(1), src[brace + 1 : _closing(src, brace)]


_EXPR_REWRITES = [
    (r"\b(?:std::)?cout\b.*", "None"),
    (r"(?:op::)?GetCurrentPlatformInfo\(\)\s*\.\s*GetSocVersion\(\)", "_soc()"),
    (r"(?:op::)?(?:SocVersion|NpuArch)::(\w+)", r"'\1'"),
    (r"\b(?:static|reinterpret)_cast<[^<>]*>", ""),
    (r"\(\s*(?:const\s+)?acl\w+\s*\*\s*\)\s*nullptr", "nullptr"),
    (r"\b(?:std::)?vector\s*<[^;]*?>\s*(?=[{(])", ""),
    (r"\b(?:std|op)::", ""),
]
_EXPR_WORDS = [
    (r"\bnullptr\b", "None"),
    (r"\btrue\b", "True"),
    (r"\bfalse\b", "False"),
    (r"(\w+)\s*\.\s*size\(\)", r"len(\1)"),
    (r"(?<![&\w)\]])&(?=\w)", ""),  # &x: the harness takes pointers; Python passes references
    (r"&&", " and "),
    (r"\|\|", " or "),
    (r"!(?!=)", " not "),
    (r"(\d(?:\.\d*)?(?:[eE][-+]?\d+)?)[fFlL]\b", r"\1"),
    (r"(\d)(?:LL|ll|UL|ul|U|u)\b", r"\1"),
]


def py_expr(cpp: str) -> str:
    text = cpp.strip()
    for pattern, repl in _EXPR_REWRITES:
        text = re.sub(pattern, repl, text)
    text = text.replace("{", "[").replace("}", "]")  # brace initializers are lists
    for pattern, repl in _EXPR_WORDS:
        text = re.sub(pattern, repl, text)
    return " ".join(text.split())


_DECLARATION = re.compile(
    r"^(?:(?:const|static|constexpr)\s+)*(?:unsigned\s+)?(?P<type>[A-Za-z_][\w:]*(?:\s*<[^;]*?>)?)\s*[*&]?\s+"
    r"(?P<name>[A-Za-z_]\w*)\s*(?:\[\s*\d*\s*\])?\s*"
    r"(?:=\s*(?P<init>.+)|(?P<braces>\{.*\})|\((?P<ctor>.*)\))?$",
    re.S,
)
_CHECK = re.compile(r"^(?:EXPECT|ASSERT)_(EQ|NE)\s*\((.*)\)$", re.S)


def py_statement(cpp: str) -> list[str]:
    """One C++ statement (no trailing ';') as Python lines."""
    cpp = cpp.strip()
    if not cpp or re.match(r"(?:std::)?cout\b", cpp):
        return []
    if m := _CHECK.match(cpp):
        left, right = (s.strip() for s in m.group(2).rsplit(",", 1))
        if re.fullmatch(r"ACL\w+", left) and not re.fullmatch(r"ACL\w+", right):
            left, right = right, left  # EXPECT_EQ(CONSTANT, status)
        return [f"_expect({m.group(1) == 'NE'}, {py_expr(left)}, {py_expr(right)})"]
    if cpp.startswith("return"):
        return ["return"]
    if (m := _DECLARATION.match(cpp)) and m["type"] != "return":
        name = m["name"]
        if m["init"] is not None:
            return [f"{name} = _dup({py_expr(m['init'])})"]  # C++ copies on initialization
        if m["braces"] is not None:
            return [f"{name} = {py_expr(m['braces'])}"]
        if m["ctor"] is not None:  # Type name(args): a constructor call (SocVersionManager v(...) included)
            return [f"{name} = {m['type'].split('::')[-1]}({py_expr(m['ctor'])})"]
        return [f"{name} = None"]
    if m := re.match(r"^([A-Za-z_]\w*)\s*=\s*(.+)$", cpp, re.S):
        return [f"{m.group(1)} = _dup({py_expr(m.group(2))})"]
    return [py_expr(cpp)]


def _end_of_statement(text: str, i: int) -> int:
    """Index of the ';' ending the statement at `i` (outside brackets and string literals)."""
    depth = 0
    while i < len(text):
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == '"':
            i = text.index('"', i + 1)
        elif ch == ";" and not depth:
            return i
        i += 1
    return i


def py_block(text: str, indent: str = "") -> list[str]:
    """A sequence of C++ statements as Python lines at `indent`."""
    lines: list[str] = []
    i = 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i >= len(text):
            return lines
        if text[i] == "{":  # a nested scope: Python has none, the statements join this one
            end = _closing(text, i)
            lines += py_block(text[i + 1 : end], indent)
            i = end + 1
        elif m := re.match(r"(for|if|while)\s*\(", text[i:]):
            paren = i + m.end() - 1
            end = _closing(text, paren)
            lines.append(indent + _header(m.group(1), text[paren + 1 : end]))
            i = _body(text, end + 1, indent, lines)
            while m.group(1) == "if" and (e := re.match(r"\s*else\b", text[i:])):
                i += e.end()
                if c := re.match(r"\s*if\s*\(", text[i:]):
                    paren = i + c.end() - 1
                    end = _closing(text, paren)
                    lines.append(f"{indent}elif {py_expr(text[paren + 1 : end])}:")
                    i = _body(text, end + 1, indent, lines)
                else:
                    lines.append(f"{indent}else:")
                    i = _body(text, i, indent, lines)
                    break
        else:
            end = _end_of_statement(text, i)
            lines += [indent + line for line in py_statement(text[i:end])]
            i = end + 1


def _header(keyword: str, head: str) -> str:
    if keyword == "if":
        return f"if {py_expr(head)}:"
    if keyword == "while":
        return f"while {py_expr(head)}:"
    if ";" not in head:  # for (auto& x : seq)
        var, seq = head.rsplit(":", 1)
        return f"for {var.split()[-1].lstrip('&*')} in {py_expr(seq)}:"
    init, cond, _ = head.split(";")  # for (T i = lo; i < hi; ++i), or <=
    var, lo = re.match(r".*?(\w+)\s*=\s*(.+)", init.strip()).groups()
    _, op, hi = re.match(r"\s*(\w+)\s*(<=|<)\s*(.+)", cond).groups()
    return f"for {var} in range({py_expr(lo)}, {py_expr(hi)}{' + 1' if op == '<=' else ''}):"


def _body(text: str, i: int, indent: str, lines: list[str]) -> int:
    """Appends the body of a for/if/else starting at `i` (a block or one statement); returns where it ends."""
    while text[i] in " \t\r\n":
        i += 1
    before = len(lines)
    if text[i] == "{":
        end = _closing(text, i)
        lines += py_block(text[i + 1 : end], indent + "    ")
    else:
        end = _end_of_statement(text, i)
        lines += py_block(text[i : end + 1], indent + "    ")
    if len(lines) == before:
        lines.append(indent + "    pass")
    return end + 1


# ----------------------------------------------------------------------------------------- driver


def _soc_of(test: str, rec: Recorder) -> tuple[str, str]:
    """The SoC a case assumes and on what ground."""
    if rec.soc_set:
        return rec.soc_set, "set by the test"
    if m := re.match(r"(?i)(ascend\w+?)_", test):
        return m.group(1).upper(), "the test's name"
    return STUB_DEFAULT_SOC, "UT stub default"


def _case(source, path, test, op, soc, params, expected, note=None) -> dict:
    (repo, commit), op_dir = source, path.split("/tests/")[0]
    case = {
        "id": f"{test}@{op_dir}",
        "repository": repo,
        "commit": commit,
        "file": path,
        "test": test,
        "soc": soc[0],
        "soc_basis": soc[1],
        "operator": op,
        "params": params,
        "expected": expected,
    }
    if note:
        case["note"] = note
    return case


def cases_of_file(source, path: str, src: str) -> tuple[list[dict], Counter]:
    global REC
    cases, skipped = [], Counter()
    ops_named = {name: name for name in re.findall(r"\baclnn\w+", src)}
    for test, body in tests_of(src):
        code = "def _test():\n" + "\n".join(py_block(body, "    ") or ["    pass"]) + "\n_test()\n"
        REC = Recorder()
        namespace = _harness_names() | ops_named
        try:
            exec(compile(code, f"{path}::{test}", "exec"), namespace)
        except Exception as e:
            raise RuntimeError(f"{path}::{test} did not translate: {type(e).__name__}: {e}\n{code}") from e
        soc = _soc_of(test, REC)
        for call, expected in REC.checked:
            if call["params"] is None:
                skipped[call["op"]] += 1
                continue
            cases.append(_case(source, path, test, call["op"], soc, call["params"], expected))
    return cases, skipped


def layer_norm_grad_cases(source, path: str, src: str) -> list[dict]:
    cases = []
    for test, x, stats, gamma, (x_dt, stats_dt, gamma_dt) in LAYER_NORM_GRAD:
        if not re.search(rf"\b{test}\b", src):
            raise RuntimeError(f"{path}: no test {test} any more; update LAYER_NORM_GRAD")

        def t(shape, dtype):
            return {"shape": shape, "dtype": dtype, "format": "ND"}

        params = {
            "dy": t(x, x_dt),
            "x": t(x, x_dt),
            "variance": t(stats, stats_dt),
            "mean": t(stats, stats_dt),
            "gamma": t(gamma, gamma_dt),
            "output_mask": None,
            "pd_x": t(x, x_dt),
            "pd_gamma": t(gamma, gamma_dt),
            "pd_beta": t(gamma, gamma_dt),
        }
        note = "graph infer-shape UT (GRAPH_SUCCESS and these output shapes), translated by hand"
        cases.append(_case(source, path, test, "LayerNormGrad", ("n/a", "graph-level UT"), params, "SUCCESS", note))
    return cases


def _numbered(cases: list[dict]) -> list[dict]:
    """Several checked calls in one test: ids get #1, #2, ... in call order."""
    count = Counter(c["id"] for c in cases)
    seen: Counter = Counter()
    for c in cases:
        if count[c["id"]] > 1:
            seen[c["id"]] += 1
            test, _, where = c["id"].partition("@")
            c["id"] = f"{test}#{seen[c['id']]}@{where}"
    return cases


def read(repo_dir: Path, commit: str, path: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo_dir), "show", f"{commit}:{path}"], check=True, capture_output=True, text=True
    ).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops-nn", type=Path, required=True, help="a clone of hicann/ops-nn (bare is fine)")
    parser.add_argument("--ops-math", type=Path, required=True, help="a clone of hicann/ops-math (bare is fine)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    clones = {OPS_NN: args.ops_nn, OPS_MATH: args.ops_math}

    cases, skipped = [], Counter()
    for source, path in SOURCES:
        file_cases, file_skipped = cases_of_file(source, path, read(clones[source], source[1], path))
        cases += file_cases
        skipped += file_skipped
    source, path = LAYER_NORM_GRAD_FILE
    cases += layer_norm_grad_cases(source, path, read(clones[source], source[1], path))
    cases = _numbered(cases)
    assert len({c["id"] for c in cases}) == len(cases)

    # One case per line: a regenerated file diffs case by case.
    args.out.write_text("[\n" + ",\n".join(json.dumps(c) for c in cases) + "\n]\n")
    print(f"{len(cases)} cases -> {args.out}")
    for (op, expected), n in sorted(Counter((c["operator"], c["expected"]) for c in cases).items()):
        print(f"  {op:38} {expected:14} {n:4}")
    if skipped:
        print("checked calls to operators not served, left out:", dict(skipped))


if __name__ == "__main__":
    main()
