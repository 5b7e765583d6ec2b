"""The explainer's and checker's words, in English and Chinese (the terms the seeds use)."""
from __future__ import annotations

LANGS = ("en", "zh")

_T = {
    "doc_title": ("Scaled dot-product attention, step by step", "缩放点积注意力：一步一步手算"),
    "overview": ("Attention(Q, K, V) = softmax(Q·Kᵀ / √d_k) · V", "Attention(Q, K, V) = softmax(Q·Kᵀ / √d_k) · V"),
    "overview_mha": ("Multi-head attention: split Q, K, V into heads → per head softmax(Q_h·K_hᵀ / √d_k) · V_h → "
                     "concat → (· W_O)",
                     "多头注意力：把 Q、K、V 拆分成多个头 → 每个头 softmax(Q_h·K_hᵀ / √d_k) · V_h → 拼接 → （· W_O）"),
    "tokens": ("Tokens", "词"),
    "kv_tokens": ("Key/value tokens", "键/值一侧的词"),
    "step": ("Step {n}", "步骤{n}"),
    "shape": ("shape", "形状"),
    "head": ("head {h}", "头 {h}"),
    "batch": ("batch {b}", "批次 {b}"),
    "t_X": ("Input: token vectors X", "输入：词向量 X"),
    "t_X_kv": ("Input: key/value-side token vectors X_kv", "输入：键/值一侧的词向量 X_kv"),
    "t_in_Q": ("Query Q (given)", "查询 Q（Query，已给定）"),
    "t_in_K": ("Key K (given)", "键 K（Key，已给定）"),
    "t_in_V": ("Value V (given)", "值 V（Value，已给定）"),
    "t_in_scores": ("Attention scores (given)", "注意力分数（已给定）"),
    "t_in_other": ("Input {name}", "输入 {name}"),
    "t_Q": ("Query: {formula}", "查询（Query）：{formula}"),
    "t_K": ("Key: {formula}", "键（Key）：{formula}"),
    "t_V": ("Value: {formula}", "值（Value）：{formula}"),
    "t_final_output": ("Output projection: {formula}", "最终线性变换：{formula}"),
    "t_matmul": ("{formula}", "{formula}"),
    "t_scores": ("Attention scores: Q · Kᵀ (dot products)", "注意力分数：Q · Kᵀ（点积）"),
    "t_scaled": ("Scaling: ÷ √d_k", "缩放：除以 √d_k"),
    "t_scaled_custom": ("Scaling: × {scale}", "缩放：乘以 {scale}"),
    "t_masked": ("Mask (before softmax)", "掩码（在 softmax 之前）"),
    "t_weights": ("Softmax: attention weights", "Softmax：注意力权重"),
    "t_dropout": ("Dropout on the weights", "对权重做 Dropout"),
    "t_output": ("Weighted sum of V: output = weights · V", "加权求和：输出 = 权重 · V"),
    "t_heads": ("Split {name} into heads", "把 {name} 拆分成多个头"),
    "t_repeated": ("Share key/value heads ({name}, grouped-query)", "共享键/值头（{name}，分组查询）"),
    "t_concat": ("Concatenate the heads", "拼接所有头"),
    "n_proj": ("Each element is a row of {a} times a column of {b} (“row times column, summed”):",
               "矩阵乘法就是“行乘列求和”：{a} 的一行乘以 {b} 的一列："),
    "n_scores": ("scores[i, j] = q_i · k_j: how well query i matches key j.",
                 "scores[i, j] = q_i · k_j：查询 i 与键 j 的匹配度（点积）。"),
    "n_scaled": ("Divide by √d_k = √{d} ≈ {sqrt} (× {scale}) so the softmax does not saturate.",
                 "除以 √d_k = √{d} ≈ {sqrt}（即乘以 {scale}），避免点积过大导致 softmax 饱和。"),
    "n_scaled_custom": ("Multiply by the scale {scale} (given instead of 1/√d_k).",
                        "乘以给定的缩放系数 {scale}（代替 1/√d_k）。"),
    "n_mask": ("Where the mask is ✗ the score becomes −∞, so its weight will be exactly 0 (✓ = may attend).",
               "掩码为 ✗ 的位置分数变为 −∞，softmax 后权重恰为 0（✓ = 可以关注）。"),
    "n_mask_float": ("The float mask is added to the scaled scores.", "浮点掩码直接加到缩放后的分数上。"),
    "n_softmax": ("softmax(x)_j = exp(x_j − max) / Σ_k exp(x_k − max). Subtracting the row maximum cancels out "
                  "(the textbook exp(x_j) / Σ exp(x_k) is the same number) and keeps exp from overflowing; these "
                  "are the values qkv computed.",
                  "softmax(x)_j = exp(x_j − max) / Σ_k exp(x_k − max)。先减去该行最大值，分子分母同乘 exp(−max)，"
                  "结果与教科书的 exp(x_j) / Σ exp(x_k) 相同，又能避免 exp 溢出；下面是 qkv 实际算出的数。"),
    "n_output": ("Each output element is the weighted sum of a column of V, with the row's weights:",
                 "每个输出元素都是 V 的一列按该行权重的加权和："),
    "n_split": ("{src} {src_shape} → view (batch, seq, heads, d_k) → transpose(1, 2) → {name} {shape} = "
                "(batch, heads, seq, d_k); head h takes columns h·d_k … (h+1)·d_k − 1.",
                "{src} {src_shape} → view (batch, seq, heads, d_k) → transpose(1, 2) → {name} {shape} = "
                "(batch, heads, seq, d_k)；第 h 个头取第 h·d_k … (h+1)·d_k − 1 列。"),
    "n_concat": ("Each head's output {src_shape} → transpose(1, 2) → view (batch, seq, heads·d_k) = {shape}: the "
                 "heads side by side.", "每个头的输出 {src_shape} → transpose(1, 2) → view (batch, seq, heads·d_k) "
                 "= {shape}：各头并排拼接。"),
    "n_repeat": ("Each of the {hk} key/value heads serves {n} query heads.", "每个键/值头服务 {n} 个查询头（共 {hk} 个键/值头）。"),
    "n_dropout": ("Kept weights are divided by 1 − p = {keep}; dropped ones become 0.",
                  "保留的权重除以 1 − p = {keep}，丢弃的变为 0。"),
    "row": ("row {label}", "{label} 行"),
    "max": ("max", "最大值"),
    "sum": ("sum", "总和"),
    "exp_row": ("exp(x − max)", "exp(x − max)"),
    "weights_row": ("weights = exp / sum", "权重 = exp / 总和"),
    "masked_entry": ("masked", "已掩码"),
    "summary": ("{n} values: min {min}, max {max}, mean {mean}", "共 {n} 个数：最小 {min}，最大 {max}，平均 {mean}"),
    "first_rows": ("first {k} of {n} rows, first {c} of {m} columns", "前 {k}/{n} 行，前 {c}/{m} 列"),
    "one_element": ("one element written out (each of the {n} elements is computed the same way):",
                    "写出其中一个元素（其余 {n} 个元素同理）："),
    "slices_more": ("(showing {shown}; the other {rest} are computed the same way — explain_query(head=…) shows "
                    "any one)", "（只显示 {shown}；其余 {rest} 个同理 —— 用 explain_query(head=…) 查看任意一个）"),
    "terms_more": ("… ({n} terms)", "…（共 {n} 项）"),
    "result": ("Result", "结果"),
    # explain_query
    "q_title": ("Query {label}: its whole calculation{where}", "查询 {label} 的完整计算{where}"),
    "q_vec": ("The query vector q = {name}[{label}]", "查询向量 q = {name}[{label}]"),
    "q_scores": ("Scores: q · k_j for every key j", "分数：q 与每个键 k_j 的点积"),
    "q_scaled": ("Scaling", "缩放"),
    "q_mask": ("Mask", "掩码"),
    "q_softmax": ("Softmax", "Softmax"),
    "q_out": ("Weighted sum of the value rows", "对值向量加权求和"),
    "q_keys_more": ("the {k} keys with the largest weights of {n}; the other {rest} keys have total weight {w}",
                    "共 {n} 个键，只列出权重最大的 {k} 个；其余 {rest} 个键的权重合计 {w}"),
    "q_after": ("This head's output row is then concatenated with the other heads' and multiplied by W_O "
                "(final_output).", "这个头的输出行随后与其他头的输出拼接，再乘以 W_O（final_output）。"),
    "q_after_concat": ("This head's output row is then concatenated with the other heads' (this example has no "
                       "W_O).", "这个头的输出行随后与其他头的输出拼接（这个例子没有 W_O）。"),
    "q_given": ("The scores were given (not computed from Q and K).", "分数是直接给定的（不是由 Q、K 计算的）。"),
    "claims_note": ("This example also holds {n} numbers its source claims: {correct} correct, {carried} carried, "
                    "{wrong} wrong — `{how}` shows which. Below: the true calculation.",
                    "这个例子还记录了原文声称的 {n} 个数：{correct} 个正确，{carried} 个继承错误，{wrong} 个错误 —— "
                    "`{how}` 会逐个列出。下面是真实的计算过程。"),
    # check
    "c_title": ("Check: {title}", "检查：{title}"),
    "c_summary": ("{n} claimed numbers: {correct} correct, {carried} carried, {wrong} wrong",
                  "共 {n} 个声称的数：{correct} 个正确，{carried} 个继承错误，{wrong} 个错误"),
    "c_ok": ("Every claimed number is right.", "所有声称的数都正确。"),
    "c_none": ("The file claims no numbers (add a claims: section to check some).",
               "文件没有声称任何数（在 claims: 下写出要检查的数）。"),
    "c_roots": ("Root mistakes (wrong: match neither the true value nor what follows from the earlier claims):",
                "根源错误（wrong：既不等于真实值，也不能由前面声称的数推出）："),
    "c_carried": ("Carried into (carried: follow from the earlier claimed values, but are not the true values):",
                  "被继承的错误（carried：能由前面声称的数推出，但不是真实值）："),
    "c_correct": ("Correct:", "正确："),
    "c_claimed": ("claimed", "声称"),
    "c_true": ("true", "真实值"),
    "c_from": ("from the claims", "由声称的数推出"),
    "c_rule": ("Match rule: |claimed − value| ≤ max(half a unit in the last decimal written, 0.1% of |value|)",
               "匹配规则：|声称值 − 值| ≤ max(所写最后一位小数的半个单位, |值| 的 0.1%)"),
    "c_rule_tol": ("Match rule: |claimed − value| ≤ {tol} (the file's tolerance)",
                   "匹配规则：|声称值 − 值| ≤ {tol}（文件给定的 tolerance）"),
    "status_correct": ("correct", "正确"),
    "status_carried": ("carried", "继承错误"),
    "status_wrong": ("wrong", "错误"),
}


def t(key: str, lang: str, **kw) -> str:
    en, zh = _T[key]
    s = zh if lang == "zh" else en
    return s.format(**kw) if kw else s


def check_lang(lang) -> str:
    if lang not in LANGS:
        raise ValueError(f"lang: expected one of {', '.join(LANGS)}, got {lang!r}")
    return lang
