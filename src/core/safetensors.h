// The safetensors file format (https://github.com/huggingface/safetensors): an 8-byte
// little-endian header length, a JSON header naming each tensor's dtype, shape and byte range,
// then the raw little-endian data. hax stores model weights and checkpoints in it so that Python
// users can load them with `safetensors.torch.load_file`.
#pragma once
#include <ATen/ATen.h>

#include <map>
#include <string>

namespace hax {

struct SafetensorsFile {
  std::map<std::string, at::Tensor> tensors;       // name -> CPU tensor
  std::map<std::string, std::string> metadata;     // the header's "__metadata__" (strings only)
};

// Serializes tensors (any device; copied to CPU, made contiguous) and metadata to bytes.
std::string safetensors_serialize(const std::map<std::string, at::Tensor>& tensors,
                                  const std::map<std::string, std::string>& metadata);

// Parses bytes; `what` names the source in errors ("checkpoint runs/x/last.safetensors").
// Every inconsistency (truncation, bad JSON, bad offsets, unknown dtype) is a UsageError.
SafetensorsFile safetensors_parse(const std::string& bytes, const std::string& what);

// Atomic save (see write_file_atomic) and load.
void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});
SafetensorsFile load_safetensors(const std::string& path, const std::string& what = "safetensors file");

}  // namespace hax
