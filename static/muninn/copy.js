// "Copy" buttons beside commands: the clipboard where the browser allows it, else the text is selected.
(function () {
  "use strict";
  document.querySelectorAll("button.copy").forEach((button) => {
    button.addEventListener("click", async () => {
      const node = document.getElementById(button.dataset.copy);
      const text = node.textContent;
      try {
        await navigator.clipboard.writeText(text);
        button.textContent = "Copied";
      } catch (e) {
        const range = document.createRange();
        range.selectNodeContents(node);
        const selection = window.getSelection();
        selection.removeAllRanges();
        selection.addRange(range);
        button.textContent = "Selected: press Ctrl-C";
      }
      window.setTimeout(() => { button.textContent = "Copy"; }, 2500);
    });
  });
})();
