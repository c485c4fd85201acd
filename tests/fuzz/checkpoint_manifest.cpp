// libFuzzer target: arbitrary bytes as a training checkpoint (tessel/dist/checkpoint.hpp), through
// the loader. The input is
//   byte 0        flags: bit 0 set = the harness writes the rank file's true size and content hash
//                 into the manifest's first file entry (so the fuzzer gets past the hash check to
//                 the pieces; clear, the manifest's own numbers are checked)
//   bytes 1..4    L, the manifest's length (little-endian; clamped to what follows)
//   L bytes       checkpoint.json
//   the rest      rank-00000.safetensors
// written into a directory of this process; then ckpt::read (the manifest, its chain of bases, the
// files, every piece's place) and, for each piece of at most 64 Ki elements, ckpt::assemble of its
// parameter's "value" into a buffer of the size its own shape gives. Any tessel::error is a
// refusal; anything else (another exception, a crash, a sanitizer report) is a bug.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <tessel/dist/checkpoint.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace fs = std::filesystem;
  namespace ckpt = tessel::dist::ckpt;
  if (size < 5) return 0;
  struct scratch {  // this process's directory, removed at exit
    fs::path root = fs::temp_directory_path() / ("fuzz_checkpoint_" + std::to_string(::getpid())), dir = root / "c";
    scratch() { fs::create_directories(dir); }
    ~scratch() {
      std::error_code ec;
      fs::remove_all(root, ec);
    }
  };
  static const scratch s;
  const fs::path& dir = s.dir;
  std::uint32_t len = 0;
  std::memcpy(&len, data + 1, 4);
  const std::size_t L = std::min<std::size_t>(len, size - 5);
  std::string manifest(reinterpret_cast<const char*>(data + 5), L);
  const char* file = reinterpret_cast<const char*>(data + 5 + L);
  const std::size_t file_size = size - 5 - L;
  if (data[0] & 1) {  // the true size and hash of the rank file
    auto j = nlohmann::json::parse(manifest, nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.contains("files") && j["files"].is_array() && !j["files"].empty() && j["files"][0].is_object()) {
      ckpt::content_hash h;
      h.add(std::as_bytes(std::span<const char>(file, file_size)));
      j["files"][0]["bytes"] = file_size;
      j["files"][0]["hash"] = ckpt::hex(h.value());
      manifest = j.dump();
    }
  }
  std::ofstream(dir / tessel::dist::checkpoint_manifest, std::ios::binary | std::ios::trunc).write(manifest.data(), std::streamsize(manifest.size()));
  std::ofstream(dir / ckpt::rank_file(0), std::ios::binary | std::ios::trunc).write(file, std::streamsize(file_size));
  try {
    const auto ix = ckpt::read(dir);
    for (const auto& [param, pieces] : ix.pieces)
      for (const auto& p : pieces) {
        if (p.kind != "value" || p.geo.numel() > (std::size_t(1) << 16)) continue;
        std::vector<float> out(p.geo.numel());
        try {
          ckpt::assemble(ix, param, p.shape, "value", p.geo, 0, out.size(), out.data());
        } catch (const tessel::error&) {}
      }
  } catch (const tessel::error&) {}
  return 0;
}
