from django import forms


class DatasetUploadForm(forms.Form):
    """The upload page's form; the same fields as POST /api/datasets, which the page's script posts to."""

    file = forms.FileField(allow_empty_file=True, help_text="CSV, NPZ, a zip of class-folder images, plain text "
                           "(.txt) or .safetensors base weights.")
    name = forms.CharField(max_length=200, required=False, help_text="Defaults to the file's name.")
    target = forms.CharField(max_length=200, required=False,
                             help_text="A table's target column (default: the last column).")
    task = forms.ChoiceField(choices=[("", "detect"), ("classification", "classification"),
                                      ("regression", "regression")], required=False)
    tokenizer = forms.ChoiceField(choices=[("", "char (default)"), ("char", "char"), ("byte", "byte")],
                                  required=False, help_text="For text only.")
    sensitive = forms.BooleanField(required=False, label="Sensitive data", help_text=(
        "Its shards go only to devices the site trusts (a verified record and age staff set), every shard download "
        "is logged on the job page, and it is encrypted at rest. Chosen now: it cannot be changed later."))
