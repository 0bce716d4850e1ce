// The MoE router's choice after the gate matmul, one call a layer: scores (softmax or sigmoid), DeepSeek's
// correction bias and group-limited selection, top-k, normalisation and scaling (torch: six to ten ops, each a
// dispatch that costs more than its arithmetic at one token).
//
// Legend: T tokens, E experts, K experts a token, G expert groups.
#pragma once

#include <cstdint>

namespace hm {

struct RouteArgs {
  const float* logits = nullptr;  // [T, E] at logits_stride
  int64_t logits_stride = 0;
  int64_t tokens = 0, experts = 0;
  int k = 0;
  bool sigmoid = false;          // scores = sigmoid(logits), else softmax over E
  const float* bias = nullptr;   // [E] or null: experts are chosen by scores + bias (noaux_tc), weighted by scores
  int groups = 1, topk_groups = 1;  // groups > 1: only experts of the topk_groups groups of largest top-2 sum
  bool normalize = false;        // weights / (their sum + norm_eps)
  float norm_eps = 0.0f;
  float scale = 1.0f;            // weights * scale (routed_scaling_factor)
  int64_t* ids = nullptr;        // [T, K] out, in descending order of the choice (ties: the lower id first)
  float* weights = nullptr;      // [T, K] out
};

// Tokens one after another on the calling thread: a decode step routes one token, a prefill chunk's few thousand
// take microseconds each.
void route(const RouteArgs& a);

}  // namespace hm
