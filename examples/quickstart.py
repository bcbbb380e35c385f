"""Quickstart: learn y = 2x + 1 with the Tensor API and SGD.

Two scalar parameters, one sample at a time, mean squared error, `backward`,
`SGD.step`, `zero_grad`. It runs eagerly; each step's graph is compiled once and
reused, so the loop is fast.

    python examples/quickstart.py
"""

from entrenar import Tensor, backward
from entrenar.optim import SGD


def main() -> tuple[float, float]:
    # Training data: y = 2x + 1
    x_data = [1.0, 2.0, 3.0, 4.0]
    y_data = [3.0, 5.0, 7.0, 9.0]

    # Parameters (trainable)
    w = Tensor.from_vec([0.0], requires_grad=True)
    b = Tensor.from_vec([0.0], requires_grad=True)
    optimizer = SGD(lr=0.01, momentum=0.0)

    for epoch in range(200):
        total_loss = 0.0
        for x, y_true in zip(x_data, y_data):
            x_tensor = Tensor.from_vec([x])
            y_pred = w * x_tensor + b  # forward: y = w·x + b
            diff = y_pred - Tensor.from_vec([y_true])
            loss = diff * diff  # squared error
            total_loss += loss.item()
            backward(loss)  # gradients into w.grad, b.grad
            optimizer.step([w, b])  # w ← w − lr·∂loss/∂w
            optimizer.zero_grad([w, b])
        if epoch % 20 == 0:
            print(f"Epoch {epoch:3d}: loss = {total_loss / len(x_data):.6f}")

    print("\nLearned parameters:")
    print(f"w = {w.item():.4f} (expected: 2.0)")
    print(f"b = {b.item():.4f} (expected: 1.0)")
    return w.item(), b.item()


if __name__ == "__main__":
    main()
