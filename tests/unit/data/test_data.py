import torch

from kdsweep.data.sampling import StepSampler
from kdsweep.data.mixing import hold_out
from kdsweep.data.text import EMBEDDED_CORPUS, embedded_corpus, tokenize_to_sequences
from helpers import word_tokenizer


def test_split_is_seeded_disjoint_and_complete():
    a = hold_out(40, 0.1, seed=7)
    assert a == hold_out(40, 0.1, seed=7)
    assert a != hold_out(40, 0.1, seed=8)
    train, held = a
    assert len(held) == 4 and not set(train) & set(held) and sorted(train + held) == list(range(40))
    assert len(hold_out(3, 0.01, seed=0)[1]) == 1  # at least one row is held out


def test_embedded_corpus_is_real_text_with_a_held_out_split():
    c = embedded_corpus(eval_fraction=0.05, split_seed=1234)
    assert len(c.train) + len(c.eval) == len(EMBEDDED_CORPUS.read_text().splitlines()) >= 100
    assert c.eval and "In the beginning God created the heaven and the earth." in "".join(c.train + c.eval)


def test_sequences_are_windows_of_the_eos_joined_stream():
    tok = word_tokenizer()
    docs = ["the cat sat", "on a mat while dogs ran", "over hills"]
    seqs = tokenize_to_sequences(tok, docs, seq_len=4)
    stream = []
    for d in docs:
        stream += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert seqs.shape == ((len(stream) - 1) // 4, 5)
    for i, row in enumerate(seqs.tolist()):
        assert row == stream[4 * i: 4 * i + 5]  # inputs row[:-1], labels row[1:] line up with the stream


def test_sampler_is_resumable_and_world_size_independent():
    s = StepSampler(num_sequences=23, batch_size=8, seed=3)
    first = [s.global_batch(k) for k in range(10)]
    fresh = StepSampler(23, 8, 3)
    assert torch.equal(fresh.global_batch(7), first[7])  # a pure function of (seed, step): resume needs only the step
    # every sequence is seen once per epoch
    seen = torch.cat(first)[:23]
    assert sorted(seen.tolist()) == list(range(23))
    for world in (1, 2, 4):
        shares = [torch.cat(s.rank_micro_batches(5, r, world, micro_batch_size=1)) for r in range(world)]
        assert torch.equal(torch.cat(shares), first[5])
