"""Pictures of attention: matplotlib heatmaps (the ``viz`` extra) and the offline interactive page.

matplotlib is imported only when a heatmap is drawn; the page needs nothing beyond NumPy.
"""
from .heatmap import cjk_font, heatmap, heads_grid, save
from .page import from_worked, model_data, playground_data, render_page, write_page

__all__ = ["cjk_font", "from_worked", "heads_grid", "heatmap", "model_data", "playground_data", "render_page",
           "save", "write_page"]
