"""DitKitPreflight: will this job fit? The packed token count, the predicted peak of one sampling step against the
memory of the device in use, and a refusal before any heavy work naming the shortfall and the settings that fit
(core: ``memory/``, host side: ``bridge/preflight.py``)."""
from __future__ import annotations

import time

from comfy_api.latest import io

from ..bridge import preflight as bridge
from ..memory.model import MemoryModelError
from ._common import report_target, send_report, ui_report

NODE_ID = "DitKitPreflight"


class DitKitPreflight(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id=NODE_ID,
            display_name="Memory Preflight (ditkit)",
            category="ditkit/sampling",
            description=("Predicts the peak memory of one MiniMax H3, LTX-2, Z-Image or FLUX.2 sampling step (weights, activations, "
                         "attention workspace, with the ditkit options on the model) from the real token count, "
                         "compares it with the memory free on the device in use, and refuses before anything "
                         "loads when it does not fit, naming the shortfall and the smallest set of settings that "
                         "fits. The same check runs again when sampling starts."),
            search_aliases=["oom", "vram check", "memory check", "will it fit", "token count", "preflight"],
            inputs=[
                io.Model.Input("model", tooltip="A MiniMax H3, LTX-2, Z-Image or FLUX.2 model, after the ditkit nodes that change its "
                                                "memory (DitKit Activation Chunking, quantized loaders)."),
                io.Latent.Input("latent", tooltip="The latent the sampler will denoise (H3: audio-video; LTX-2: video "
                                                  "or audio-video; Z-Image, FLUX.2: an image latent)."),
                io.Float.Input("limit_gib", default=0.0, min=0.0, max=4096.0, step=0.5,
                               tooltip="Memory the job may use, in GiB. 0 = what the device in use has free (on a "
                                       "CPU host: free RAM), plus what this model already holds there."),
                io.Int.Input("text_tokens", default=512, min=0, max=1 << 20,
                             tooltip="H3 / Z-Image / FLUX.2: text rows of the packed sequence, used until sampling starts (the "
                                     "sampler check counts the real conditioning). Not used when positive is "
                                     "connected, nor for LTX-2 (text is cross-attention context there)."),
                io.Conditioning.Input("positive", optional=True,
                                      tooltip="Optional: the conditioning the sampler will get. Its text rows, H3 "
                                              "ref2va reference blocks (images, videos, audio), fl2va keyframes, "
                                              "Z-Image omni references (with their captions and SigLIP encodings) "
                                              "and FLUX.2 reference latents are counted into the packed sequence "
                                              "now instead of at sampling."),
                io.Vae.Input("vae", optional=True,
                             tooltip="Optional: the video VAE that will decode the result. Its decode's predicted peak "
                                     "(weights, ComfyUI's working-set estimate, the decoded frames on a CPU host) "
                                     "joins the plan: the job's peak is the larger of a sampling step and the "
                                     "decode."),
                io.Float.Input("cfg", default=1.0, min=0.0, max=100.0, step=0.1, round=0.01, optional=True,
                               tooltip="Optional: the sampler's cfg. At cfg 1 ComfyUI runs the positive alone; at "
                                       "any other cfg it also runs the negative, and for LTX-2, Z-Image and FLUX.2 "
                                       "batches both into one forward (twice the activations). The report says "
                                       "which batch was assumed and the figure at the other case; the sampler "
                                       "check uses the sampler's own cfg."),
            ],
            outputs=[io.Model.Output(tooltip="The model (a clone) with the sampler-time check installed."),
                     io.Latent.Output(tooltip="The latent, unchanged.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, latent, limit_gib=0.0, text_tokens=512, positive=None, vae=None,
                cfg=1.0) -> io.NodeOutput:
        t0 = time.perf_counter()
        if isinstance(text_tokens, bool) or not isinstance(text_tokens, int) or text_tokens < 0:
            raise MemoryModelError(f"{NODE_ID}: text_tokens must be an int >= 0, got {text_tokens!r}")
        if not isinstance(latent, dict) or "samples" not in latent:
            raise MemoryModelError(f"{NODE_ID}: the latent input is not a LATENT")
        family = bridge.family_of(model)
        video, audio = bridge.latent_shapes_of(latent["samples"], family)
        text, refs, keyframes = (bridge.conditioning_rows(positive, video, text_tokens)
                                 if positive is not None and family == "h3" else (text_tokens, 0, 0))
        if positive is not None and family == "flux2":   # refs: the reference latents' shapes
            text, refs = bridge.flux2_rows(positive, text_tokens)
        zconds = bridge.zimage_conds(positive, text_tokens) if positive is not None and family == "zimage" else None
        batch = bridge.conditioning_batch(model, video, audio, cfg, positive, None, text_tokens, "input")
        p = bridge.run_plan(model, video, audio, text, limit_gib, refs, keyframes, vae, zconds, batch=batch)
        other = bridge.other_case_cfg(model, cfg)
        alt = bridge.run_plan(model, video, audio, text, limit_gib, refs, keyframes, vae, zconds,
                              batch=bridge.conditioning_batch(model, video, audio, other, positive, None, text_tokens,
                                                              "input"))
        if alt.options.batch != p.options.batch:
            p.note = (f"at cfg {'1' if other == 1.0 else '!= 1'}: batch {alt.options.batch}, predicted "
                      f"{alt.peak() / 2**30:.2f} GiB, {'fits' if alt.fits else 'does not fit'}")
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        data = dict(p.as_dict(), phase="node", seconds=time.perf_counter() - t0)
        payload = send_report(node_id, NODE_ID, "preflight", p.summary(), data)
        if not p.fits:
            raise bridge.refusal(p)
        m = model.clone()
        bridge.install(m, text_tokens, float(limit_gib), (report_target(node_id, NODE_ID), send_report), vae)
        return io.NodeOutput(m, latent, ui=ui_report(payload))


NODES = [DitKitPreflight]
