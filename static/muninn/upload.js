// The upload page: post the file to the API with XMLHttpRequest to show a progress bar, check the size limit
// before sending, and show the validator's message with where the problem is (row, column, file).
(function () {
  "use strict";
  const form = document.getElementById("upload-form");
  if (!form) return;
  const bar = document.getElementById("upload-progress");
  const status = document.getElementById("upload-status");
  const errorBox = document.getElementById("upload-error");
  const button = document.getElementById("upload-button");
  const limit = Number(document.getElementById("upload-limit").dataset.bytes);

  function fail(error) {
    errorBox.innerHTML = Muninn.errorHtml(error, "upload-error-message");
    bar.hidden = true;
    status.textContent = "";
    button.disabled = false;
  }

  form.addEventListener("submit", function (event) {
    event.preventDefault();
    const file = form.querySelector("input[type=file]").files[0];
    errorBox.innerHTML = "";
    if (!file) return fail({message: "Choose a file to upload.", detail: {field: "file"}});
    if (file.size > limit) {
      return fail({message: "The file is " + file.size.toLocaleString() + " bytes; the limit is " +
                   limit.toLocaleString() + ".", detail: {file: file.name}});
    }
    const data = new FormData(form);
    data.delete("csrfmiddlewaretoken");
    const xhr = new XMLHttpRequest();
    xhr.open("POST", form.getAttribute("data-api"));
    xhr.setRequestHeader("X-CSRFToken", Muninn.csrfToken());
    xhr.setRequestHeader("Accept", "application/json");
    xhr.upload.onprogress = function (e) {
      if (!e.lengthComputable) return;
      bar.value = Math.round((100 * e.loaded) / e.total);
      status.textContent = "Uploading… " + bar.value + "%";
    };
    xhr.upload.onload = function () { status.textContent = "Checking the data…"; };
    xhr.onload = function () {
      if (xhr.status === 201) {
        const dataset = JSON.parse(xhr.responseText);
        bar.value = 100;
        status.textContent = "Uploaded.";
        window.location.href = form.getAttribute("data-detail-url").replace(/0\/?$/, dataset.id + "/");
      } else {
        fail(Muninn.apiError(xhr.status, xhr.responseText));
      }
    };
    xhr.onerror = function () { fail({message: "The upload was interrupted (network error). Please try again.", detail: {}}); };
    bar.hidden = false;
    bar.value = 0;
    button.disabled = true;
    status.textContent = "Uploading… 0%";
    xhr.send(data);
  });
})();
