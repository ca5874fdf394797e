#include "core/safetensors.h"

#include <nlohmann/json.hpp>

#include <cstring>

#include "core/atomic_file.h"
#include "core/error.h"

namespace hax {
namespace {

struct DtypeName {
  at::ScalarType type;
  const char* name;
};
const DtypeName kDtypes[] = {
    {at::kDouble, "F64"}, {at::kFloat, "F32"}, {at::kHalf, "F16"}, {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},   {at::kInt, "I32"},   {at::kShort, "I16"}, {at::kChar, "I8"},
    {at::kByte, "U8"},    {at::kBool, "BOOL"},
};

const char* dtype_name(at::ScalarType t) {
  for (auto& d : kDtypes)
    if (d.type == t) return d.name;
  fail("safetensors: tensors of dtype {} cannot be stored", c10::toString(t));
}

bool dtype_from_name(const std::string& s, at::ScalarType* out) {
  for (auto& d : kDtypes)
    if (s == d.name) {
      *out = d.type;
      return true;
    }
  return false;
}

}  // namespace

std::string safetensors_serialize(const std::map<std::string, at::Tensor>& tensors,
                                  const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, t0] : tensors) {
    HAX_CHECK(name != "__metadata__", "safetensors: a tensor may not be named __metadata__");
    at::Tensor t = t0.detach().to(at::kCPU).contiguous();
    uint64_t nbytes = (uint64_t)t.numel() * t.element_size();
    header[name] = {{"dtype", dtype_name(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
    data.push_back(t);
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8 != 0) h.push_back(' ');  // align the data section to 8 bytes
  std::string out(8, '\0');
  uint64_t hlen = h.size();
  for (int i = 0; i < 8; ++i) out[i] = (char)((hlen >> (8 * i)) & 0xff);
  out += h;
  out.reserve(out.size() + offset);
  for (const auto& t : data) out.append((const char*)t.data_ptr(), (size_t)t.numel() * t.element_size());
  return out;
}

SafetensorsFile safetensors_parse(const std::string& bytes, const std::string& what) {
  HAX_CHECK(bytes.size() >= 8, "{} is corrupt: {} bytes is shorter than the 8-byte header length",
            what, bytes.size());
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i) hlen |= (uint64_t)(uint8_t)bytes[i] << (8 * i);
  HAX_CHECK(hlen <= bytes.size() - 8, "{} is corrupt: header length {} exceeds the file size {}",
            what, hlen, bytes.size());
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + (long)hlen);
  } catch (const std::exception& e) {
    fail("{} is corrupt: its header is not valid JSON ({})", what, e.what());
  }
  HAX_CHECK(header.is_object(), "{} is corrupt: its header is not a JSON object", what);
  const size_t data_start = 8 + hlen;
  const uint64_t data_size = bytes.size() - data_start;
  SafetensorsFile out;
  // Byte ranges must tile the data section exactly.
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      HAX_CHECK(v.is_object(), "{} is corrupt: __metadata__ is not an object", what);
      for (auto m = v.begin(); m != v.end(); ++m) {
        HAX_CHECK(m.value().is_string(), "{} is corrupt: metadata {} is not a string", what, m.key());
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    try {
      at::ScalarType type;
      std::string dt = v.at("dtype").get<std::string>();
      HAX_CHECK(dtype_from_name(dt, &type), "{} is corrupt: tensor {} has unknown dtype {}", what, name, dt);
      std::vector<int64_t> shape = v.at("shape").get<std::vector<int64_t>>();
      auto off = v.at("data_offsets").get<std::vector<uint64_t>>();
      HAX_CHECK(off.size() == 2 && off[0] <= off[1] && off[1] <= data_size,
                "{} is corrupt: tensor {} has byte range outside the data section", what, name);
      uint64_t numel = 1;
      for (int64_t s : shape) {
        HAX_CHECK(s >= 0, "{} is corrupt: tensor {} has a negative dimension", what, name);
        numel *= (uint64_t)s;
      }
      uint64_t nbytes = numel * c10::elementSize(type);
      HAX_CHECK(nbytes == off[1] - off[0],
                "{} is corrupt: tensor {} of shape {} needs {} bytes but its range holds {}", what, name,
                nlohmann::json(shape).dump(), nbytes, off[1] - off[0]);
      at::Tensor t = at::empty(shape, at::TensorOptions().dtype(type));
      if (nbytes) std::memcpy(t.data_ptr(), bytes.data() + data_start + off[0], nbytes);
      out.tensors[name] = t;
      ranges.push_back({off[0], off[1]});
    } catch (const nlohmann::json::exception& e) {
      fail("{} is corrupt: entry {} is malformed ({})", what, name, e.what());
    }
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t pos = 0;
  for (auto& r : ranges) {
    HAX_CHECK(r.first == pos, "{} is corrupt: tensor byte ranges overlap or leave gaps", what);
    pos = r.second;
  }
  HAX_CHECK(pos == data_size, "{} is corrupt: {} bytes of data but the tensors cover {}", what, data_size, pos);
  return out;
}

void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  write_file_atomic(path, safetensors_serialize(tensors, metadata));
}

SafetensorsFile load_safetensors(const std::string& path, const std::string& what) {
  std::string label = what + " " + path;
  return safetensors_parse(read_file(path, what), label);
}

}  // namespace hax
