"""Gradio 6.31's cost per streamed update of a panel shaped like ui._Panel (max_generations 4, 2 agents),
one part's text and the status changed: (a) every other output left alone (dict return = gr.skip()
for the rest: the panel before stop 55), (b) every Markdown output named with its current text and
the rest left alone (ui._Panel.stream since stop 55)."""
import asyncio, time, gradio as gr
from gradio.state_holder import SessionState
G, W = 4, 2
with gr.Blocks() as demo:
    st = gr.State()
    status = gr.Markdown("")
    cols, heads, parts, checks, ratings = [], [], [], [], []
    for i in range(G):
        with gr.Column(visible=False) as c:
            heads.append(gr.Markdown())
            with gr.Row():
                parts += [gr.Markdown() for _ in range(W)]
            checks.append(gr.Markdown())
            ratings.append(gr.Radio(["1", "2", "3", "4", "5"], visible=False))
        cols.append(c)
    with gr.Row(visible=False) as rate_row:
        gr.Textbox()
    with gr.Row(visible=False) as forms_row:
        best = gr.Radio([])
        ranks = [gr.Dropdown([], visible=False) for _ in range(G)]
    rate_msg = gr.Markdown()
    with gr.Row(visible=False) as round_row:
        cont = gr.Dropdown([])
    btn = gr.Button()
    outs = [status, *cols, *heads, *parts, *checks, *ratings, rate_row, forms_row, best, *ranks, rate_msg, round_row, cont, st]
    ev = btn.click(lambda: None, None, outs)
fn = list(demo.fns.values())[-1]
state = SessionState(demo)
async def main():
    print("outputs", len(outs))
    markdowns = [status, rate_msg, *heads, *checks, *parts]
    for _ in range(2):
        t = time.perf_counter(); n = 100
        for k in range(n):
            await demo.postprocess_data(fn, {parts[0]: f"> text {k}", status: f"*generating {k}*"}, state)
        print("(a) one update (2 values, the rest left alone):", round((time.perf_counter() - t) / n * 1000, 2), "ms")
        t = time.perf_counter()
        for k in range(n):
            upd = {c: "> the same text" for c in markdowns}
            upd.update({parts[0]: f"> text {k}", status: f"*generating {k}*"})
            await demo.postprocess_data(fn, upd, state)
        print(f"(b) one update ({len(markdowns)} Markdown values, the rest left alone):",
              round((time.perf_counter() - t) / n * 1000, 2), "ms")
asyncio.run(main())
