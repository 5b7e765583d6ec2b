"""Pictures of attention: matplotlib heatmaps (the ``viz`` extra) and the offline interactive page.

matplotlib is imported only when a heatmap is drawn; the page needs nothing beyond NumPy.
"""
from .heads import HeadKinds, attention_flow, head_kinds, model_name, rollout
from .heatmap import cjk_font, heatmap, heads_grid, layout, save
from .page import from_worked, model_data, playground_data, render_page, write_page

__all__ = ["HeadKinds", "attention_flow", "cjk_font", "from_worked", "head_kinds", "heads_grid", "heatmap", "layout",
           "model_data", "model_name", "playground_data", "render_page", "rollout", "save", "write_page"]
