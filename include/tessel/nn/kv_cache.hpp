// A paged KV cache for incremental decoding: per layer, K and V pages [num_pages, page_size,
// heads_kv, head_dim] in the model's compute type (the layout ops::attention_decode reads in
// place), one page allocator (a free list) shared by every layer, and per sequence a block table
// (the page of each page_size tokens, the same pages in every layer) and a length.
//
// Appending is three steps so that a model can write each layer's rows as it computes them:
// reserve (pages for the new tokens, all or none), write (a layer's rows), commit (the length
// grows). A sequence's rows beyond its length are never read. A reservation may also say that only
// the last `keep` tokens will be read again (a sliding window): the pages that hold only older
// tokens go back to the free list (their block-table entries become -1), so a windowed sequence
// holds about keep / page_size + 1 pages however long it grows. A block table is a ring of
// pages_per_seq entries (page p of a sequence is entry p % pages_per_seq), so a windowed sequence
// may also grow past max_length, as long as the pages its window spans fit the ring. Errors are
// nn_error: out of pages or of sequence slots (errc::out_of_range), a sequence id that is not live
// (errc::invalid_argument), a sequence longer than the cache's max_length without a window that
// fits its ring (errc::out_of_range), sizes (errc::overflow).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <tessel/detail/checked.hpp>
#include <tessel/device/device.hpp>
#include <tessel/device/device_buffer.hpp>
#include <tessel/nn/errors.hpp>
#include <tessel/nn/layers.hpp>
#include <tessel/ops/attention.hpp>

namespace tessel {
inline namespace v0 {
namespace nn {

struct kv_cache_shape {
  std::size_t layers = 0, heads_kv = 0, head_dim = 0;
  std::size_t page_size = 16;     // tokens per page
  std::size_t num_pages = 0;      // pages shared by all sequences (each page holds every layer's rows)
  std::size_t max_sequences = 1;  // live sequences at once
  std::size_t max_length = 0;     // tokens per sequence (a windowed one may grow past it: reserve)
};

template <device Dev, compute_type T>
class kv_cache {
 public:
  using seq_id = std::size_t;

  kv_cache(Dev& dev, const kv_cache_shape& s) : dev_(&dev), s_(s) {
    if (s.layers == 0 || s.heads_kv == 0 || s.head_dim == 0 || s.page_size == 0 || s.num_pages == 0 || s.max_sequences == 0 || s.max_length == 0)
      throw nn_error(errc::invalid_argument, "kv_cache: a zero dimension (layers " + std::to_string(s.layers) + ", heads_kv " +
                                                 std::to_string(s.heads_kv) + ", head_dim " + std::to_string(s.head_dim) + ", page_size " +
                                                 std::to_string(s.page_size) + ", pages " + std::to_string(s.num_pages) + ", sequences " +
                                                 std::to_string(s.max_sequences) + ", max_length " + std::to_string(s.max_length) + ")");
    constexpr std::size_t i32 = std::size_t(std::numeric_limits<std::int32_t>::max());
    // attention_decode takes lengths and page indices as int32
    if (s.num_pages > i32 || s.max_length > i32)
      throw nn_error(errc::overflow, "kv_cache: " + std::to_string(s.num_pages) + " pages or " + std::to_string(s.max_length) +
                                         " tokens per sequence do not fit int32 indices");
    pages_per_seq_ = (s.max_length + s.page_size - 1) / s.page_size;
    row_ = detail::mul_checked(s.heads_kv, s.head_dim, "kv_cache size");
    page_elems_ = detail::mul_checked(s.page_size, row_, "kv_cache size");
    layer_elems_ = detail::mul_checked(s.num_pages, page_elems_, "kv_cache size");
    const std::size_t total = detail::mul_checked(layer_elems_, s.layers, "kv_cache size");
    (void)detail::mul_checked(total, 2 * sizeof(T), "kv_cache bytes");
    (void)detail::mul_checked(s.max_sequences, pages_per_seq_, "kv_cache block tables");
    k_ = device_buffer<T, Dev>::zeros(dev, total);
    v_ = device_buffer<T, Dev>::zeros(dev, total);
    free_.resize(s.num_pages);
    for (std::size_t p = 0; p < s.num_pages; ++p) free_[p] = std::int32_t(s.num_pages - 1 - p);  // pop_back hands out page 0 first
    table_.assign(s.max_sequences * pages_per_seq_, -1);
    seqs_.resize(s.max_sequences);
  }
  kv_cache(kv_cache&&) noexcept = default;
  kv_cache& operator=(kv_cache&&) noexcept = default;

  const kv_cache_shape& shape() const noexcept { return s_; }
  Dev& device() const noexcept { return *dev_; }
  std::size_t pages_per_seq() const noexcept { return pages_per_seq_; }
  std::size_t free_pages() const noexcept { return free_.size(); }
  std::size_t live_sequences() const noexcept { return live_; }
  // Whether the pages of any `keep` consecutive tokens (at most ceil((keep - 1) / page_size) + 1)
  // fit a block table: then a sequence reserved with that window may grow past max_length.
  bool holds_window(std::size_t keep) const noexcept { return keep >= 1 && (keep - 1 + s_.page_size - 1) / s_.page_size + 1 <= pages_per_seq_; }

  // A new empty sequence (the lowest free slot).
  seq_id add_sequence() {
    for (seq_id i = 0; i < seqs_.size(); ++i)
      if (!seqs_[i].live) {
        seqs_[i] = slot{true, 0, 0, 0, false};
        ++live_;
        return i;
      }
    throw nn_error(errc::out_of_range, "kv_cache: all " + std::to_string(s_.max_sequences) + " sequence slots are in use");
  }
  // Its pages go back to the free list; the id may be handed out again.
  void release(seq_id s) {
    slot& q = at(s, "release");
    for (std::size_t p = q.pages; p-- > q.first;) {
      free_.push_back(entry(s, p));
      entry(s, p) = -1;
    }
    q = slot{};
    --live_;
  }
  bool contains(seq_id s) const noexcept { return s < seqs_.size() && seqs_[s].live; }
  std::size_t length(seq_id s) const { return at(s, "length").len; }
  // Tokens the sequence's pages hold (its length plus reserved room; up to max_length unless a
  // windowed reservation took it past).
  std::size_t reserved(seq_id s) const {
    const slot& q = at(s, "reserved");
    return q.past ? q.pages * s_.page_size : std::min(q.pages * s_.page_size, s_.max_length);
  }
  // The first token the cache still holds: the tokens before it were given back by a reserve with
  // `keep` (0 if none was).
  std::size_t first_token(seq_id s) const { return at(s, "first_token").first * s_.page_size; }
  // Pages the sequence holds.
  std::size_t pages_held(seq_id s) const {
    const slot& q = at(s, "pages_held");
    return q.pages - q.first;
  }

  // Room for counts[i] more tokens of ids[i] (ids distinct): the pages they need come from the free
  // list, for all of them or (an error) for none. With `keep` (>= 1), only the last `keep` tokens of
  // each sequence (counted to its end after the reservation) will be read or written again: pages
  // holding only older tokens are given back first (and count toward the pages available), and
  // none is taken for them. A sequence may grow past max_length only this way: while the pages
  // holding its last `keep` tokens fit its block table (at most pages_per_seq of them, which
  // holds_window(keep) guarantees), up to 2^31 - 1 tokens.
  void reserve(std::span<const seq_id> ids, std::span<const std::size_t> counts, std::size_t keep = std::numeric_limits<std::size_t>::max()) {
    if (ids.size() != counts.size())
      throw nn_error(errc::invalid_argument,
                     "kv_cache: reserve of " + std::to_string(ids.size()) + " sequences with " + std::to_string(counts.size()) + " counts");
    if (keep == 0) throw nn_error(errc::invalid_argument, "kv_cache: reserve keeping 0 tokens");
    check_distinct(ids, "reserve");
    std::size_t need = 0, freed = 0;
    std::vector<std::size_t> want(ids.size()), drop(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const slot& q = at(ids[i], "reserve");
      const std::size_t end = detail::add_checked(q.len, counts[i], "kv_cache length");
      want[i] = (end + s_.page_size - 1) / s_.page_size;
      // pages [q.first, drop[i]) hold only tokens before end - keep (drop[i] < want[i]: the last token stays)
      drop[i] = std::max(q.first, end > keep ? (end - keep) / s_.page_size : 0);
      if (end > s_.max_length && (end <= keep || want[i] - drop[i] > pages_per_seq_))
        throw nn_error(errc::out_of_range,
                       "kv_cache: sequence " + std::to_string(ids[i]) + " would hold " + std::to_string(end) + " tokens, more than its max_length " +
                           std::to_string(s_.max_length) +
                           (end <= keep ? std::string()
                                        : " with a window of " + std::to_string(keep) + " tokens in " + std::to_string(want[i] - drop[i]) +
                                              " pages, more than the " + std::to_string(pages_per_seq_) + " of its block table"));
      if (end > std::size_t(std::numeric_limits<std::int32_t>::max()))
        throw nn_error(errc::overflow,
                       "kv_cache: sequence " + std::to_string(ids[i]) + " would hold " + std::to_string(end) + " tokens, past int32 lengths");
      freed += std::min(q.pages, drop[i]) - std::min(q.pages, q.first);
      const std::size_t from = std::max(q.pages, drop[i]);
      if (want[i] > from) need += want[i] - from;
    }
    if (need > free_.size() + freed)
      throw nn_error(errc::out_of_range, "kv_cache: out of pages: " + std::to_string(need) + " needed, " + std::to_string(free_.size() + freed) +
                                             " of " + std::to_string(s_.num_pages) + " free");
    for (std::size_t i = 0; i < ids.size(); ++i) {
      slot& q = seqs_[ids[i]];
      for (; q.first < drop[i]; ++q.first)
        if (q.first < q.pages) {
          free_.push_back(entry(ids[i], q.first));
          entry(ids[i], q.first) = -1;
        }
      q.pages = std::max(q.pages, q.first);
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      slot& q = seqs_[ids[i]];
      for (; q.pages < want[i]; ++q.pages) {
        entry(ids[i], q.pages) = free_.back();
        free_.pop_back();
      }
      q.past = q.past || q.len + counts[i] > s_.max_length;
    }
  }
  void reserve(seq_id s, std::size_t n, std::size_t keep = std::numeric_limits<std::size_t>::max()) {
    reserve(std::span<const seq_id>(&s, 1), std::span<const std::size_t>(&n, 1), keep);
  }

  // Layer `layer`'s rows of tokens [pos, pos + n) of sequence s from k and v (n rows of
  // heads_kv·head_dim, `ld` elements apart); the tokens must be reserved.
  void write(std::size_t layer, seq_id s, std::size_t pos, const T* k, const T* v, std::size_t n, std::size_t ld) {
    const slot& q = at(s, "write");
    if (layer >= s_.layers)
      throw nn_error(errc::invalid_argument, "kv_cache: no layer " + std::to_string(layer) + " of " + std::to_string(s_.layers));
    if (n == 0) return;
    if (pos > q.pages * s_.page_size || n > q.pages * s_.page_size - pos)
      throw nn_error(errc::out_of_range, "kv_cache: tokens [" + std::to_string(pos) + ", " + std::to_string(pos + n) + ") of sequence " +
                                             std::to_string(s) + " are not reserved (" + std::to_string(q.pages) + " pages)");
    if (pos < q.first * s_.page_size)
      throw nn_error(errc::out_of_range, "kv_cache: token " + std::to_string(pos) + " of sequence " + std::to_string(s) +
                                             " was given back (the cache holds tokens from " + std::to_string(q.first * s_.page_size) + ")");
    if (ld < row_) throw nn_error(errc::invalid_argument, "kv_cache: row stride " + std::to_string(ld) + " below the row of " + std::to_string(row_));
    T* kl = k_.data() + layer * layer_elems_;
    T* vl = v_.data() + layer * layer_elems_;
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t j = pos + i, off = std::size_t(entry(s, j / s_.page_size)) * page_elems_ + (j % s_.page_size) * row_;
      std::copy(k + i * ld, k + i * ld + row_, kl + off);
      std::copy(v + i * ld, v + i * ld + row_, vl + off);
    }
  }
  // The sequence's length grows by n (the rows must have been written in every layer).
  void commit(seq_id s, std::size_t n) {
    slot& q = at(s, "commit");
    if (n > reserved(s) - q.len)
      throw nn_error(errc::out_of_range, "kv_cache: commit of " + std::to_string(n) + " tokens to sequence " + std::to_string(s) + " of length " +
                                             std::to_string(q.len) + " with room for " + std::to_string(reserved(s)));
    q.len += n;
  }
  // reserve + write every layer + commit: k and v are [layers, n, heads_kv·head_dim].
  void append(seq_id s, std::span<const T> k, std::span<const T> v) {
    const std::size_t per = detail::mul_checked(s_.layers, row_, "kv_cache append");
    if (k.size() != v.size() || k.size() % per != 0)
      throw nn_error(errc::invalid_argument, "kv_cache: append of " + std::to_string(k.size()) + " K and " + std::to_string(v.size()) +
                                                 " V elements, not [layers, n, " + std::to_string(row_) + "]");
    const std::size_t n = k.size() / per;
    reserve(s, n);
    for (std::size_t l = 0; l < s_.layers; ++l) write(l, s, length(s), k.data() + l * n * row_, v.data() + l * n * row_, n, row_);
    commit(s, n);
  }

  // What attention_decode reads: layer l's pages, and a sequence's block table (a ring of
  // pages_per_seq entries: page p is entry p % pages_per_seq; -1 for entries no held page uses).
  std::span<const T> k(std::size_t layer) const { return {k_.data() + layer_check(layer) * layer_elems_, layer_elems_}; }
  std::span<const T> v(std::size_t layer) const { return {v_.data() + layer_check(layer) * layer_elems_, layer_elems_}; }
  std::span<const std::int32_t> block_table(seq_id s) const {
    (void)at(s, "block_table");
    return {table_.data() + s * pages_per_seq_, pages_per_seq_};
  }
  // Token j's K (or V) row of layer l (heads_kv·head_dim elements), j < the reserved tokens.
  const T* k_row(std::size_t layer, seq_id s, std::size_t j) const { return k_.data() + layer_check(layer) * layer_elems_ + row_offset(s, j); }
  const T* v_row(std::size_t layer, seq_id s, std::size_t j) const { return v_.data() + layer_check(layer) * layer_elems_ + row_offset(s, j); }

  // The paged-cache shape of attention_decode for `batch` sequences, one query row each.
  attention_decode_shape decode_shape(std::size_t batch, std::size_t heads_q, std::size_t seq_q = 1) const {
    attention_decode_shape d;
    d.batch = batch;
    d.seq_q = seq_q;
    d.heads_q = heads_q;
    d.heads_kv = s_.heads_kv;
    d.head_dim = s_.head_dim;
    d.page_size = s_.page_size;
    d.num_pages = s_.num_pages;
    d.pages_per_seq = pages_per_seq_;
    d.ring = true;
    return d;
  }
  // The block tables of ids, one after another ([batch, pages_per_seq]).
  void gather_tables(std::span<const seq_id> ids, std::vector<std::int32_t>& out) const {
    out.resize(ids.size() * pages_per_seq_);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const auto t = block_table(ids[i]);
      std::copy(t.begin(), t.end(), out.begin() + std::ptrdiff_t(i * pages_per_seq_));
    }
  }
  // Throws unless the ids are distinct live sequences.
  void check_distinct(std::span<const seq_id> ids, const char* what) const {
    std::vector<seq_id> sorted(ids.begin(), ids.end());
    std::sort(sorted.begin(), sorted.end());
    for (std::size_t i = 0; i < sorted.size(); ++i) {
      (void)at(sorted[i], what);
      if (i > 0 && sorted[i] == sorted[i - 1])
        throw nn_error(errc::invalid_argument,
                       std::string("kv_cache: ") + what + ": sequence " + std::to_string(sorted[i]) + " appears twice in one batch");
    }
  }

 private:
  struct slot {
    bool live = false;
    std::size_t len = 0, pages = 0;  // tokens; pages taken (counted from the sequence's first page)
    std::size_t first = 0;           // pages before it were given back (their entries -1)
    bool past = false;               // a windowed reservation took it past max_length
  };
  const slot& at(seq_id s, const char* what) const {
    if (s >= seqs_.size() || !seqs_[s].live)
      throw nn_error(errc::invalid_argument,
                     std::string("kv_cache: ") + what + ": sequence " + std::to_string(s) + " is not a live sequence of this cache");
    return seqs_[s];
  }
  slot& at(seq_id s, const char* what) { return const_cast<slot&>(static_cast<const kv_cache*>(this)->at(s, what)); }
  std::size_t layer_check(std::size_t layer) const {
    if (layer >= s_.layers)
      throw nn_error(errc::invalid_argument, "kv_cache: no layer " + std::to_string(layer) + " of " + std::to_string(s_.layers));
    return layer;
  }
  std::size_t row_offset(seq_id s, std::size_t j) const {
    const slot& q = at(s, "row");
    if (j >= q.pages * s_.page_size)
      throw nn_error(errc::out_of_range, "kv_cache: token " + std::to_string(j) + " of sequence " + std::to_string(s) + " is not reserved");
    if (j < q.first * s_.page_size)
      throw nn_error(errc::out_of_range, "kv_cache: token " + std::to_string(j) + " of sequence " + std::to_string(s) + " was given back");
    return std::size_t(entry(s, j / s_.page_size)) * page_elems_ + (j % s_.page_size) * row_;
  }
  // The block-table entry of sequence s's page p (counted from its first page): the table is a ring.
  std::int32_t& entry(seq_id s, std::size_t p) { return table_[s * pages_per_seq_ + p % pages_per_seq_]; }
  std::int32_t entry(seq_id s, std::size_t p) const { return table_[s * pages_per_seq_ + p % pages_per_seq_]; }

  Dev* dev_;
  kv_cache_shape s_;
  std::size_t pages_per_seq_ = 0, row_ = 0, page_elems_ = 0, layer_elems_ = 0, live_ = 0;
  device_buffer<T, Dev> k_, v_;      // [layers][num_pages, page_size, heads_kv, head_dim]
  std::vector<std::int32_t> free_;   // free pages (a stack)
  std::vector<std::int32_t> table_;  // [max_sequences, pages_per_seq]
  std::vector<slot> seqs_;
};

}  // namespace nn
}  // namespace v0
}  // namespace tessel
