"""Pictures of attention: matplotlib heatmaps (the ``viz`` extra) and the offline interactive page.

matplotlib is imported only when a heatmap is drawn; the page needs nothing beyond NumPy.
"""
from qkv.viz.heads import HeadKinds, attention_flow, head_kinds, model_name, rollout
from qkv.viz.heatmap import cjk_font, heatmap, heads_grid, layout, save
from qkv.viz.page import (MAX_PAGE_BYTES, PageTooLarge, decoder_attentions, from_worked, generation_data, model_data,
                   playground_data, render_page, why_data, worked_data, write_page)
from qkv.viz.page_hf import compare_data, hf_generation_data
from qkv.viz.page_long import long_data
from qkv.viz.notebook import Shown, show
from qkv.viz.lab_plots import plot as plot_lab   # qkv.lab's experiments drawn (the lab returns data)

__all__ = ["HeadKinds", "attention_flow", "cjk_font", "from_worked", "head_kinds", "heads_grid", "heatmap", "layout",
           "model_data", "model_name", "playground_data", "render_page", "rollout", "save", "write_page"]
__all__ += ["MAX_PAGE_BYTES", "PageTooLarge", "Shown", "decoder_attentions", "generation_data", "show",
            "why_data", "worked_data"]
__all__ += ["plot_lab"]
__all__ += ["compare_data", "hf_generation_data"]
__all__ += ["long_data"]
