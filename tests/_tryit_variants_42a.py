"""4.2a's try-its: answers written apart from the references (see _tryit_variants.py)."""

VARIANTS = {
    "no_sync": {
        "mistakes": [
            ("every micro-batch synchronises", [("contextlib.nullcontext() if last else ddp_model.no_sync()",
                                                 "contextlib.nullcontext()")], "4 times for 4 micro-batches"),
            ("the loss is not divided", [(" / len(micro_batches)", "")], "4 times the right size"),
            ("no micro-batch synchronises", [("contextlib.nullcontext() if last else ddp_model.no_sync()",
                                              "ddp_model.no_sync()")], "never averaged"),
        ],
        "correct": [
            ("an ExitStack and a running sum of the loss", [
                ("        last = i == len(micro_batches) - 1\n"
                 "        with contextlib.nullcontext() if last else ddp_model.no_sync():\n"
                 "            loss = F.mse_loss(ddp_model(x), y) / len(micro_batches)\n"
                 "            loss.backward()",
                 "        with contextlib.ExitStack() as stack:\n"
                 "            if i + 1 < len(micro_batches):\n"
                 "                stack.enter_context(ddp_model.no_sync())\n"
                 "            (F.mse_loss(ddp_model(x), y) * (1 / len(micro_batches))).backward()")]),
        ],
    },
}
