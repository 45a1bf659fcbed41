// The ATen pieces the kernels use. <torch/extension.h> pulls in the whole C++ frontend and took ~10x as long
// to compile (a build per instruction set made that count); the module definition (decode_kernels.cpp) adds
// <torch/python.h> for the Tensor casters.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
