// hax bench: performance measurements (JSON plus a readable table).
#include <fmt/format.h>

#include "bench/ssm_bench.h"
#include "commands.h"
#include "config_file.h"
#include "core/atomic_file.h"
#include "core/error.h"
#include "core/threads.h"
#include "options.h"

namespace hax::cli {

Command add_bench_command(CLI::App& app) {
  auto* sub = app.add_subcommand("bench", "benchmarks (JSON and a table)");
  sub->require_subcommand(1);
  auto* ssm = sub->add_subcommand("ssm", "Mamba / Mamba-2 mixers and the SSD scan: forward and forward+backward");
  struct State {
    bench::SsmBenchConfig cfg;
    std::string lengths = "1k,4k,16k", json = "bench-ssm.json", device = "cpu";
    int threads = 0;
  };
  auto st = std::make_shared<State>();
  ssm->add_option("--lengths", st->lengths, "sequence lengths, e.g. 1k,4k,16k");
  ssm->add_option("--batch", st->cfg.batch, "batch size");
  ssm->add_option("--d-model", st->cfg.d_model, "mixer width (d_inner = 2 d_model)");
  ssm->add_option("--headdim", st->cfg.headdim, "Mamba-2 head dim");
  ssm->add_option("--d-state", st->cfg.d_state_mamba2, "Mamba-2 state size");
  ssm->add_option("--mamba-d-state", st->cfg.d_state_mamba, "Mamba state size");
  ssm->add_option("--chunk", st->cfg.chunk, "SSD chunk length");
  ssm->add_option("--naive-max-len", st->cfg.naive_max_len, "longest L for the naive recurrence");
  ssm->add_option("--repeats", st->cfg.repeats, "timed runs per measurement");
  ssm->add_option("--json", st->json, "JSON output file");
  ssm->add_option("--device", st->device, "cpu");
  add_threads_option(ssm, &st->threads);
  Command c;
  c.app = sub;
  c.run = [st]() {
    HAX_CHECK(st->device == "cpu", "--device {}: this build of hax benchmarks the CPU only", st->device);
    st->cfg.lengths = parse_size_list(st->lengths, "--lengths");
    HAX_CHECK(st->cfg.batch > 0, "--batch {} must be positive", st->cfg.batch);
    HAX_CHECK(st->cfg.repeats > 0, "--repeats {} must be positive", st->cfg.repeats);
    set_threads(st->threads);
    nlohmann::json report = bench::run_ssm_bench(st->cfg);
    write_file_atomic(st->json, report.dump(2) + "\n");
    fmt::print("wrote {}\n", st->json);
    return kExitOk;
  };
  return c;
}

}  // namespace hax::cli
