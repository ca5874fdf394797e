#include "options.h"

namespace hax::cli {

void add_config_option(CLI::App* app, std::string* path) {
  app->add_option("--config", *path,
                  "config file (TOML-style key = value); flags given after it override its values");
}

void add_threads_option(CLI::App* app, int* threads) {
  app->add_option("--threads", *threads, "CPU threads (0 = all cores)");
}

void add_model_options(CLI::App* app, ModelConfig* m) {
  const char* g = "Model";
  app->add_option("--mixer", m->mixer, "sequence mixer: mamba (S6), mamba2 (SSD), samba (Mamba layers interleaved with sliding-window attention) or transformer (attention layers of --attention's kind)")->group(g);
  app->add_option("--vocab-size", m->vocab_size, "embedding rows (must exceed the task's largest token id)")->group(g);
  app->add_option("--d-model", m->d_model, "residual stream width")->group(g);
  app->add_option("--n-layers", m->n_layers, "number of residual blocks")->group(g);
  app->add_option("--expand", m->expand, "inner width d_inner = expand * d_model")->group(g);
  app->add_option("--d-state", m->d_state, "SSM state size N (paper: Mamba-2 32, Mamba 16)")->group(g);
  app->add_option("--d-conv", m->d_conv, "causal conv width")->group(g);
  app->add_option("--headdim", m->headdim, "Mamba-2 head dim P (heads = d_inner / headdim)")->group(g);
  app->add_option("--ngroups", m->ngroups, "Mamba-2 B/C groups (must divide the head count)")->group(g);
  app->add_option("--chunk-size", m->chunk_size, "Mamba-2 SSD chunk length (speed only)")->group(g);
  app->add_option("--dt-rank", m->dt_rank, "Mamba dt projection rank (0 = ceil(d_model/16))")->group(g);
  app->add_option("--dt-min", m->dt_min, "smallest initial dt")->group(g);
  app->add_option("--dt-max", m->dt_max, "largest initial dt")->group(g);
  app->add_option("--dt-init-floor", m->dt_init_floor, "floor of the initial dt")->group(g);
  app->add_option("--norm-eps", m->norm_eps, "RMSNorm epsilon")->group(g);
  app->add_option("--init-std", m->init_std, "std of the embedding initialization")->group(g);
  app->add_flag("--tie-embeddings,!--no-tie-embeddings", m->tie_embeddings, "LM head shares the embedding")->group(g);
  app->add_flag("--rescale-prenorm-residual,!--no-rescale-prenorm-residual", m->rescale_prenorm_residual,
                "scale out_proj init by 1/sqrt(n_layers)")
      ->group(g);
  const char* s = "Sparse attention";
  app->add_option("--sparse", m->sparse, "sparse attention branch: none, sw, d, sw+d, a, lsh, ks, hax, dma, hsa or full")->group(s);
  app->add_option("--sparse-keys", m->sparse_keys, "k: keys per query (split evenly across a union's parts)")->group(s);
  app->add_option("--attn-heads", m->attn_heads, "heads of the sparse branch")->group(s);
  app->add_option("--qk-dim", m->qk_dim, "query/key width per head (0 = d_state)")->group(s);
  app->add_option("--qk-init", m->qk_init, "random, or bc: Q and K start as the SSM's C and B")->group(s);
  app->add_option("--lsh-bits", m->lsh_bits, "LSH hyperplanes h")->group(s);
  app->add_option("--lsh-binning", m->lsh_binning, "LSH buckets: sign (2^h) or argmax (h)")->group(s);
  app->add_option("--dilated-span", m->dilated_span, "dilated stride = dilated_span / keys per part")->group(s);
  app->add_option("--ks-hidden", m->ks_hidden, "Key Selection scorer width (0 = 2 qk_dim)")->group(s);
  app->add_option("--ks-candidates", m->ks_candidates, "keys sampled per row for the ranking loss (0 = k part)")->group(s);
  app->add_option("--hsa-chunk", m->hsa_chunk, "HSA: tokens per chunk")->group(s);
  app->add_option("--hsa-topk", m->hsa_topk, "HSA: chunks each query retrieves")->group(s);
  app->add_option("--hsa-landmark", m->hsa_landmark, "HSA landmarks: cls (bidirectional chunk encoder) or mean")->group(s);
  app->add_option("--hsa-dim", m->hsa_dim, "HSA retrieval width (0 = the input width)")->group(s);
  const char* sa = "Attention layers (samba, transformer)";
  app->add_option("--attention", m->attention, "transformer attention: full, swa, swa+hsa or dma")->group(sa);
  app->add_option("--swa-window", m->swa_window, "sliding attention window")->group(sa);
  app->add_option("--swa-heads", m->swa_heads, "attention heads")->group(sa);
  app->add_option("--mlp-ratio", m->mlp_ratio, "SwiGLU width ratio")->group(sa);
  app->add_option("--rope-theta", m->rope_theta, "RoPE base")->group(sa);
}

void add_train_options(CLI::App* app, TrainConfig* t) {
  const char* g = "Training";
  app->add_option("--run-dir", t->run_dir, "run directory (config, metrics, checkpoints)")->group(g);
  app->add_option("--seed", t->seed, "seed of model init, data and splits")->group(g);
  app->add_option("--threads", t->threads, "CPU threads (0 = all cores)")->group(g);
  app->add_option("--device", t->device, "cpu, cuda (cuda:N) or auto (cuda when a GPU is present)")->group(g);
  app->add_option("--precision", t->precision, "fp32, or bf16 (autocast on CUDA; float32 weights)")->group(g);
  app->add_flag("--deterministic,!--no-deterministic", t->deterministic,
                "CUDA: fixed-order backward reductions (bit-identical reruns)")->group(g);
  app->add_option("--cuda-graphs", t->cuda_graphs,
                  "CUDA: auto, on or off: replay each step from a captured CUDA graph (batches padded to a fixed "
                  "shape); auto times eager steps against replays and keeps the faster")->group(g);
  app->add_option("--steps", t->steps, "optimizer steps")->group(g);
  app->add_option("--batch-size", t->batch_size, "samples per step")->group(g);
  app->add_option("--lr", t->lr, "peak learning rate")->group(g);
  app->add_option("--min-lr", t->min_lr, "cosine schedule floor")->group(g);
  app->add_option("--schedule", t->schedule, "after warmup: constant or cosine")->group(g);
  app->add_option("--warmup-steps", t->warmup_steps, "linear warmup steps")->group(g);
  app->add_option("--weight-decay", t->weight_decay, "AdamW weight decay")->group(g);
  app->add_option("--beta1", t->beta1, "AdamW beta1")->group(g);
  app->add_option("--beta2", t->beta2, "AdamW beta2")->group(g);
  app->add_option("--adam-eps", t->adam_eps, "AdamW epsilon")->group(g);
  app->add_option("--grad-clip", t->grad_clip, "max global gradient norm (0 = off)")->group(g);
  app->add_option("--ranking-alpha", t->ranking_alpha, "weight of the Key Selection ranking losses")->group(g);
  app->add_option("--swa-warmup-window", t->swa_warmup_window,
                  "sliding window of the attention layers during the warm-up (0 = no warm-up)")->group(g);
  app->add_option("--swa-warmup-steps", t->swa_warmup_steps, "steps of the window warm-up")->group(g);
  app->add_flag("--pack,!--no-pack", t->pack, "pack samples into rows (state resets between them)")->group(g);
  app->add_option("--pack-len", t->pack_len, "packed row length (0 = the task's longest sample)")->group(g);
  app->add_option("--log-every", t->log_every, "steps between metric lines")->group(g);
  app->add_option("--eval-every", t->eval_every, "steps between validations")->group(g);
  app->add_option("--save-every", t->save_every, "steps between checkpoints")->group(g);
  app->add_option("--n-valid", t->n_valid, "validation samples")->group(g);
  app->add_option("--n-test", t->n_test, "test samples")->group(g);
  app->add_option("--eval-batch-size", t->eval_batch_size, "samples per evaluation batch")->group(g);
  app->add_flag("--resume", t->resume, "continue the run in --run-dir from its last checkpoint")->group(g);
  app->add_flag("--overwrite", t->overwrite, "start afresh even if --run-dir holds a run")->group(g);
  app->add_flag("--progress,!--no-progress", t->progress, "show a progress bar")->group(g);
}

}  // namespace hax::cli
