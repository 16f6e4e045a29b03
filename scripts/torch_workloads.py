"""The workloads of scripts/pytorch_compare.py, run in its child process.

Each is a function `build(torch, dev, rng, steps) -> (shapes, step)`: it
builds the model on `dev` (random-initialised from a configuration;
nothing is downloaded), draws from `rng` the shapes of all `steps` steps
up front, and returns them with `step(shape)`, which runs one step and
returns its loss (or a checksum of what it generated). Every allocator
runs the same seed, so the same shapes in the same order, and the same
values: the losses must match native's. torch is passed in, not imported
here, so that the parent (and `--table` on a machine without PyTorch) can
read the names without it.

Models, in MODELS order:

    gpt2-train         GPT-2 small, eager attention, batch 2-16, 64-1024 tokens
    gpt2-generate      GPT-2 small, greedy generation, batch 1-8, prompts of
                       16-512 tokens, 8-64 new tokens
    resnet50-train     torchvision ResNet-50, batch 16-64, images of 128-256 pixels
    gqa-decoder-train  a Llama-style decoder (about 330M parameters, 16 query
                       heads sharing 4 key/value heads), bf16 autocast, AdamW,
                       batch 4, 128-1024 tokens drawn each step
    vit-train          torchvision ViT-B/16, bf16 autocast, AdamW, batch 64 at 224 pixels
    unet-train         a diffusion-style UNet (three levels, attention at the
                       lowest, timestep embedding), bf16 autocast, AdamW,
                       batch 32 of 4x64x64 latents, noise-prediction loss
    moe-train          a transformer whose MLPs are 8 experts with top-2
                       routing, bf16 autocast, AdamW, batch 8 of 512 tokens:
                       each expert's tensors are as large as the tokens routed
                       to it, so their sizes change every step
    serve-loop         the Llama-style decoder in bf16 serving batches of 1-16
                       requests, each prompt 16-512 tokens (left-padded), a
                       prefill and 2-8 greedy decode steps with a KV cache,
                       in inference mode
    gan-train          a DCGAN (a generator of 64x64 images from 128 values
                       of noise, a discriminator), batch 128, each trained
                       by its own AdamW: two optimizer steps a step

Probes (not models; run only when named):

    gather-probe       random reads over one 16 GiB tensor
    copy-probe         a 2 GiB tensor copied into another, eight times a step
    calls-probe        a trace's allocation calls through PyTorch's allocator
                       interface, no kernels
"""

import gzip
import math
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent


# ---- GPT-2 and ResNet-50 -----------------------------------------------------


def gpt2_model(torch, dev):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config()
    # Eager attention: deterministic, and the allocation pattern of the
    # attention matrices is the fragmenting one.
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config).to(dev), config


def optimizer_step(opt, loss):
    """Backward, one optimizer step, gradients dropped: a training step's
    end. Returns the loss, for the check that allocators agree."""
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def greedy_checksum(model, ids, mask, new):
    """Generates exactly `new` tokens greedily after `ids` (prompts ending
    at the last column) and returns a checksum of them, which stands in
    for a loss."""
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )
    return float(out[:, ids.shape[1] :].sum().item())


def gpt2_train(torch, dev, rng, steps):
    model, config = gpt2_model(torch, dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shapes = [(rng.choice([2, 4, 8, 12, 16]), rng.choice([64, 128, 256, 384, 512, 768, 1024])) for _ in range(steps)]

    def step(shape):
        batch, seq = shape
        ids = torch.randint(0, config.vocab_size, (batch, seq), device=dev)
        loss = model(input_ids=ids, labels=ids).loss
        return optimizer_step(opt, loss)

    return shapes, step


def gpt2_generate(torch, dev, rng, steps):
    model, config = gpt2_model(torch, dev)
    model.eval()
    shapes = [(rng.choice([1, 2, 4, 8]), rng.randint(16, 512), rng.randint(8, 64)) for _ in range(steps)]

    def step(shape):
        batch, prompt, new = shape
        ids = torch.randint(1, config.vocab_size, (batch, prompt), device=dev)
        with torch.no_grad():
            return greedy_checksum(model, ids, torch.ones_like(ids), new)

    return shapes, step


def resnet50_train(torch, dev, rng, steps):
    import torchvision

    model = torchvision.models.resnet50(weights=None).to(dev)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    shapes = [(rng.choice([16, 32, 48, 64]), rng.choice([128, 160, 192, 224, 256])) for _ in range(steps)]

    def step(shape):
        batch, size = shape
        x = torch.randn(batch, 3, size, size, device=dev)
        y = torch.randint(0, 1000, (batch,), device=dev)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        return optimizer_step(opt, loss)

    return shapes, step


# ---- a decoder with grouped-query attention -----------------------------------


def llama_model(torch, dev):
    """A Llama-style decoder of about 330M parameters: 24 layers of width
    1024, 16 query heads sharing 4 key/value heads (grouped-query
    attention), SwiGLU MLPs of 2816, a 32,000-token vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )
    # Eager attention, as GPT-2's: deterministic (SDPA's fused kernels may
    # sum their gradients in any order), and the attention matrices, as
    # large as the sequence squared, change size with every step.
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config).to(dev), config


def gqa_decoder_train(torch, dev, rng, steps):
    model, config = llama_model(torch, dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # A fixed batch and a length drawn each step, any length, not a few
    # buckets: every step's activations are of sizes not seen before.
    batch = 4
    shapes = [rng.randint(128, 1024) for _ in range(steps)]

    def step(seq):
        ids = torch.randint(0, config.vocab_size, (batch, seq), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        return optimizer_step(opt, loss)

    return shapes, step


def serve_loop(torch, dev, rng, steps):
    model, config = llama_model(torch, dev)
    model.to(torch.bfloat16).eval()
    # Each step a batch of requests: their prompt lengths, and the tokens
    # to generate for all of them.
    shapes = []
    for _ in range(steps):
        prompts = tuple(rng.randint(16, 512) for _ in range(rng.randint(1, 16)))
        shapes.append((prompts, rng.randint(2, 8)))

    def step(shape):
        prompts, new = shape
        width = max(prompts)
        lengths = torch.tensor(prompts, device=dev)
        # Left padding, as a decoder-only model is served: each prompt ends
        # at the last column, where generation starts.
        mask = torch.arange(width, device=dev)[None, :] >= (width - lengths)[:, None]
        ids = torch.randint(1, config.vocab_size, (len(prompts), width), device=dev).masked_fill(~mask, 0)
        with torch.inference_mode():
            return greedy_checksum(model, ids, mask.long(), new)

    return shapes, step


# ---- ViT-B/16 ------------------------------------------------------------------


def vit_train(torch, dev, rng, steps):
    import torchvision
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = torchvision.models.vit_b_16(weights=None).to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = 64

    def step(_):
        x = torch.randn(batch, 3, 224, 224, device=dev)
        y = torch.randint(0, 1000, (batch,), device=dev)
        # The math backend of scaled_dot_product_attention (which
        # nn.MultiheadAttention calls): the fused ones may sum their
        # gradients in any order, and the losses would drift apart.
        with sdpa_kernel(SDPBackend.MATH), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        return optimizer_step(opt, loss)

    return [None] * steps, step


# ---- a diffusion UNet ------------------------------------------------------------


def unet_model(torch):
    """A UNet of the kind diffusion models train, in plain torch: levels of
    128, 256 and 512 channels at 64, 32 and 16 pixels, two residual blocks
    each (the lowest with self-attention after each), a middle of two
    residual blocks around attention, and the way back up with the skips
    concatenated; every residual block takes the timestep's embedding."""
    nn, F = torch.nn, torch.nn.functional

    class ResBlock(nn.Module):
        def __init__(self, cin, cout, tdim):
            super().__init__()
            self.norm1 = nn.GroupNorm(32, cin)
            self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
            self.time = nn.Linear(tdim, cout)
            self.norm2 = nn.GroupNorm(32, cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
            self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

        def forward(self, x, t):
            h = self.conv1(F.silu(self.norm1(x)))
            h = h + self.time(t)[:, :, None, None]
            h = self.conv2(F.silu(self.norm2(h)))
            return h + self.skip(x)

    class Attention(nn.Module):
        # Written out (no scaled_dot_product_attention): deterministic.
        def __init__(self, channels, heads=8):
            super().__init__()
            self.heads = heads
            self.norm = nn.GroupNorm(32, channels)
            self.qkv = nn.Linear(channels, 3 * channels)
            self.out = nn.Linear(channels, channels)

        def forward(self, x, _t=None):
            b, c, h, w = x.shape
            tokens = self.norm(x).flatten(2).transpose(1, 2)
            q, k, v = self.qkv(tokens).view(b, h * w, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            weights = (q @ k.transpose(-2, -1) * (c // self.heads) ** -0.5).softmax(-1)
            o = (weights @ v).transpose(1, 2).reshape(b, h * w, c)
            return x + self.out(o).transpose(1, 2).reshape(b, c, h, w)

    class UNet(nn.Module):
        def __init__(self, cin=4, chans=(128, 256, 512), tdim=512):
            super().__init__()
            self.base = chans[0]
            self.time = nn.Sequential(nn.Linear(chans[0], tdim), nn.SiLU(), nn.Linear(tdim, tdim), nn.SiLU())
            self.inp = nn.Conv2d(cin, chans[0], 3, padding=1)
            self.down, self.samplers_down = nn.ModuleList(), nn.ModuleList()
            c = chans[0]
            for level, width in enumerate(chans):
                lowest = level == len(chans) - 1
                blocks = []
                for _ in range(2):
                    blocks.append(ResBlock(c, width, tdim))
                    if lowest:
                        blocks.append(Attention(width))
                    c = width
                self.down.append(nn.ModuleList(blocks))
                # Stride-2 convolutions down; transposed convolutions up
                # (deterministic, where nearest upsampling's backward may not be).
                if not lowest:
                    self.samplers_down.append(nn.Conv2d(c, c, 3, stride=2, padding=1))
            self.mid = nn.ModuleList([ResBlock(c, c, tdim), Attention(c), ResBlock(c, c, tdim)])
            self.up, self.samplers_up = nn.ModuleList(), nn.ModuleList()
            for level, width in reversed(list(enumerate(chans))):
                lowest = level == len(chans) - 1
                blocks = []
                for i in range(2):
                    # The first block takes the skip of its level, concatenated.
                    blocks.append(ResBlock(c + (width if i == 0 else 0), width, tdim))
                    if lowest:
                        blocks.append(Attention(width))
                    c = width
                self.up.append(nn.ModuleList(blocks))
                if level > 0:
                    self.samplers_up.append(nn.ConvTranspose2d(c, chans[level - 1], 4, stride=2, padding=1))
                    c = chans[level - 1]
            self.out = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, cin, 3, padding=1))

        def embed(self, t):
            """The sinusoidal embedding of timesteps `t`, `self.base` wide."""
            half = self.base // 2
            freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
            args = t[:, None].float() * freqs[None, :]
            return self.time(torch.cat([args.cos(), args.sin()], dim=1))

        def forward(self, x, t):
            t = self.embed(t)
            h = self.inp(x)
            skips = []
            for level, blocks in enumerate(self.down):
                for block in blocks:
                    h = block(h, t)
                skips.append(h)
                if level < len(self.samplers_down):
                    h = self.samplers_down[level](h)
            for block in self.mid:
                h = block(h, t)
            for level, blocks in enumerate(self.up):
                h = torch.cat([h, skips.pop()], dim=1)
                for block in blocks:
                    h = block(h, t)
                if level < len(self.samplers_up):
                    h = self.samplers_up[level](h)
            return self.out(h)

    return UNet()


def unet_train(torch, dev, rng, steps):
    model = unet_model(torch).to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch, timesteps = 32, 1000

    def step(_):
        x0 = torch.randn(batch, 4, 64, 64, device=dev)
        noise = torch.randn_like(x0)
        t = torch.randint(0, timesteps, (batch,), device=dev)
        # A cosine schedule: how much of the signal is left at step t.
        keep = torch.cos(t.float() / timesteps * math.pi / 2)[:, None, None, None] ** 2
        xt = keep.sqrt() * x0 + (1 - keep).sqrt() * noise
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(xt, t)
        loss = torch.nn.functional.mse_loss(pred.float(), noise)
        return optimizer_step(opt, loss)

    return [None] * steps, step


# ---- a mixture of experts ----------------------------------------------------------


def moe_model(torch, vocab, width=768, heads=12, layers=8, experts=8, hidden=3072):
    """A decoder whose MLPs are mixtures of `experts` experts, each token
    routed to its top two. About 370M parameters, of which about a quarter
    act on a token."""
    nn = torch.nn

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(width, experts, bias=False)
            self.experts = nn.ModuleList(
                nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)) for _ in range(experts)
            )

        def forward(self, x):
            n = x.shape[0]
            weights, chosen = self.router(x).float().softmax(-1).topk(2, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
            # The (token, choice) pairs sorted by expert: each expert gets
            # one contiguous run of its tokens, as many as were routed to it.
            flat = chosen.flatten()
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=experts).tolist()
            routed = x.index_select(0, order // 2)
            outs = [expert(part) for expert, part in zip(self.experts, routed.split(counts))]
            # Back to (token, choice) order, weighted and summed per token.
            y = torch.cat(outs).index_select(0, torch.argsort(order))
            return (y.view(n, 2, width).float() * weights[..., None]).sum(1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.norm2 = nn.LayerNorm(width)
            self.moe = MoE()

        def forward(self, x, causal):
            b, s, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            # Attention written out (no scaled_dot_product_attention): deterministic.
            scores = (q @ k.transpose(-2, -1) * (d // heads) ** -0.5).masked_fill(causal, float("-inf"))
            x = x + self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d))
            return x + self.moe(self.norm2(x).view(b * s, d)).view(b, s, d)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, ids):
            s = ids.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).triu(1)
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x, causal)
            return self.head(self.norm(x))

    return Model()


def moe_train(torch, dev, rng, steps):
    vocab, batch, seq = 32000, 8, 512
    model = moe_model(torch, vocab).to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(_):
        ids = torch.randint(0, vocab, (batch, seq + 1), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        return optimizer_step(opt, loss)

    return [None] * steps, step


# ---- probes ----------------------------------------------------------------------


def gather_probe(torch, dev, rng, steps):
    """Not a model: every step reads the same 64 Mi random 4-byte words of
    one 16 GiB tensor. Such reads miss the GPU's address-translation caches,
    so the step time shows whether the way an allocator maps its memory
    (one allocation, 32 MiB chunks, 2 MiB chunks) changes how fast kernels
    run."""
    src = torch.arange(4 << 30, device=dev, dtype=torch.float32)
    gen = torch.Generator(device=dev)
    gen.manual_seed(rng.randrange(1 << 30))
    idx = torch.randint(0, src.numel(), (1 << 26,), device=dev, generator=gen)

    def step(_):
        return float(src[idx].sum().item())

    return [None] * steps, step


def copy_probe(torch, dev, rng, steps):
    """Not a model: every step copies one 2 GiB tensor into another eight
    times, a kernel bound by the memory's bandwidth alone. The step time
    shows whether the chunks an allocator maps its memory in change how
    fast memory streams (where random reads, `gather-probe`, showed no
    change)."""
    gen = torch.Generator(device=dev)
    gen.manual_seed(rng.randrange(1 << 30))
    src = torch.rand(1 << 29, device=dev, generator=gen)
    dst = torch.empty_like(src)

    def step(_):
        for _ in range(8):
            dst.copy_(src)
        return float(dst[-1].item())

    return [None] * steps, step


DEFAULT_CALLS_TRACE = "gpt2_train_torch.trace.gz"


def read_trace(path):
    """A trace's operations, `(id, bytes, stream)` for an allocation and
    `(id, None, stream)` for a free, from the shared format (gzip or plain;
    src/trace/mod.rs reads the same): `# comment`, `a <id> <bytes>
    <stream>`, `f <id> <stream>`. Refuses what vmpool-replay refuses (an
    unknown line, an id allocated twice, a free of an id not live), naming
    the line."""
    ops, live = [], set()
    with open(path, "rb") as head:
        gzipped = head.read(2) == b"\x1f\x8b"
    with gzip.open(path, "rt") if gzipped else open(path) as f:
        for number, line in enumerate(f, 1):
            fields = line.split()
            try:
                # A step's end (`s`): the probe marks its own steps.
                if not fields or fields[0].startswith("#") or fields == ["s"]:
                    continue
                if fields[0] == "a":
                    id_, size, stream = int(fields[1]), int(fields[2]), int(fields[3])
                    if id_ in live:
                        raise ValueError(f"id {id_} allocated twice")
                    live.add(id_)
                    ops.append((id_, size, stream))
                elif fields[0] == "f":
                    id_, stream = int(fields[1]), int(fields[2])
                    if id_ not in live:
                        raise ValueError(f"free of id {id_}, which is not live")
                    live.remove(id_)
                    ops.append((id_, None, stream))
                else:
                    raise ValueError(f"unknown op {fields[0]!r}")
            except (IndexError, ValueError) as err:
                raise SystemExit(f"{path}, line {number}: {err}") from None
    return ops


def calls_probe(torch, dev, rng, steps):
    """Not a model: every step replays the allocations and frees of a trace
    recorded under PyTorch (`--calls-trace FILE`, given to the child as
    VMPOOL_CALLS_TRACE; by default GPT-2 training's,
    `traces/gpt2_train_torch.trace.gz`, 57,653 calls) through
    `torch.cuda.caching_allocator_alloc` / `_delete`, and launches nothing.
    The trace's first stream is the current stream; any other it numbers
    gets a stream of its own. What is still live at the end of the trace
    is freed then. The first step grows the pool; later ones show what the
    calls cost through PyTorch's allocator interface (its Python loop, the
    same under every allocator, included)."""
    given = os.environ.get("VMPOOL_CALLS_TRACE")
    trace = (
        Path(given)
        if given
        else next(
            p
            for p in (HERE.parent / "traces" / DEFAULT_CALLS_TRACE, HERE / "traces" / DEFAULT_CALLS_TRACE)
            if p.is_file()
        )
    )
    device = torch.cuda.current_device()
    streams = {}  # the trace's stream number -> a torch stream, kept alive
    ops, zero = [], set()
    for id_, size, stream in read_trace(trace):
        if stream not in streams:
            streams[stream] = torch.cuda.current_stream() if not streams else torch.cuda.Stream()
        # A zero-byte request: PyTorch's allocators hand out no memory for
        # it, and a plug-in's free of it is not defined; left out, with its free.
        if size == 0:
            zero.add(id_)
        elif size is None and id_ in zero:
            zero.remove(id_)
        else:
            ops.append((id_, size, streams[stream].cuda_stream))
    alloc, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete

    def step(_):
        live = {}
        for id_, size, stream in ops:
            if size is None:
                delete(live.pop(id_))
            else:
                live[id_] = alloc(size, device, stream)
        for ptr in live.values():
            delete(ptr)
        return float(len(ops))

    return [None] * steps, step


# ---- a GAN: two optimizers a step ------------------------------------------------


def gan_train(torch, dev, rng, steps):
    nn, F = torch.nn, torch.nn.functional
    noise, width, batch = 128, 64, 128

    def up(cin, cout, stride, pad):
        return [nn.ConvTranspose2d(cin, cout, 4, stride, pad, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True)]

    def down(cin, cout):
        return [nn.Conv2d(cin, cout, 4, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.2, True)]

    # 1 -> 4 -> 8 -> 16 -> 32 -> 64 pixels, and back down to one logit.
    generator = nn.Sequential(
        *up(noise, width * 8, 1, 0),
        *up(width * 8, width * 4, 2, 1),
        *up(width * 4, width * 2, 2, 1),
        *up(width * 2, width, 2, 1),
        nn.ConvTranspose2d(width, 3, 4, 2, 1, bias=False),
        nn.Tanh(),
    ).to(dev)
    discriminator = nn.Sequential(
        nn.Conv2d(3, width, 4, 2, 1, bias=False),
        nn.LeakyReLU(0.2, True),
        *down(width, width * 2),
        *down(width * 2, width * 4),
        *down(width * 4, width * 8),
        nn.Conv2d(width * 8, 1, 4, 1, 0, bias=False),
        nn.Flatten(),
    ).to(dev)
    opt_d = torch.optim.AdamW(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.AdamW(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))

    def step(_):
        real = torch.rand(batch, 3, 64, 64, device=dev) * 2 - 1
        fake = generator(torch.randn(batch, noise, 1, 1, device=dev))
        ones = torch.ones(batch, 1, device=dev)
        zeros = torch.zeros(batch, 1, device=dev)
        # The discriminator's gradients from the generator's step before.
        opt_d.zero_grad(set_to_none=True)
        loss_d = F.binary_cross_entropy_with_logits(discriminator(real), ones) + (
            F.binary_cross_entropy_with_logits(discriminator(fake.detach()), zeros)
        )
        d = optimizer_step(opt_d, loss_d)
        loss_g = F.binary_cross_entropy_with_logits(discriminator(fake), ones)
        return d + optimizer_step(opt_g, loss_g)

    return [None] * steps, step


BUILD = {
    "gpt2-train": gpt2_train,
    "gpt2-generate": gpt2_generate,
    "resnet50-train": resnet50_train,
    "gqa-decoder-train": gqa_decoder_train,
    "vit-train": vit_train,
    "unet-train": unet_train,
    "moe-train": moe_train,
    "serve-loop": serve_loop,
    "gan-train": gan_train,
    "gather-probe": gather_probe,
    "copy-probe": copy_probe,
    "calls-probe": calls_probe,
}
# Not models: run only when named in --workloads.
PROBES = ["gather-probe", "copy-probe", "calls-probe"]
MODELS = [w for w in BUILD if w not in PROBES]
