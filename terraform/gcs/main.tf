# The rendezvous bucket of one volunteer_rl run on Google Cloud Storage, a trainer service
# account and one service account per volunteer. Volunteers' rights are bucket IAM bindings
# with IAM conditions on the object name, which Cloud Storage evaluates for every object
# request made natively (gcsfs) or through the S3-compatible XML API with HMAC keys.

locals {
  # Resource names as IAM conditions see them: projects/_/buckets/BUCKET/objects/KEY.
  objects = "projects/_/buckets/${google_storage_bucket.run.name}/objects/${var.key_prefix}"

  volunteer_read_condition = join(" || ", [
    format("resource.name == %q", "${local.objects}manifest.json"),
    format("resource.name.startsWith(%q)", "${local.objects}manifests/"),
    format("resource.name.startsWith(%q)", "${local.objects}checkpoints/"),
    format("resource.name.startsWith(%q)", "${local.objects}datasets/"),
    format("resource.name.startsWith(%q)", "${local.objects}grants/"),
  ])

  trainer_member = "serviceAccount:${google_service_account.trainer.email}"
}

# ---------------------------------------------------------------------------------------
# Bucket
# ---------------------------------------------------------------------------------------

resource "google_storage_bucket" "run" {
  #checkov:skip=CKV_GCP_62:Usage logs would need a second bucket and log every volunteer write; use Cloud Audit Logs (Data Access) on the project where an audit trail is required.
  name          = var.bucket_name
  project       = var.project_id
  location      = var.location
  storage_class = "STANDARD"
  force_destroy = var.force_destroy
  labels        = merge({ "project" = "volunteer-rl" }, var.labels)

  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"

  versioning {
    enabled = true
  }

  lifecycle_rule {
    condition {
      age            = var.rollout_expiration_days
      matches_prefix = ["${var.key_prefix}rollouts/"]
      with_state     = "LIVE"
    }
    action {
      type = "Delete"
    }
  }

  dynamic "lifecycle_rule" {
    for_each = var.checkpoint_expiration_days > 0 ? [var.checkpoint_expiration_days] : []

    content {
      condition {
        age            = lifecycle_rule.value
        matches_prefix = ["${var.key_prefix}checkpoints/"]
        with_state     = "LIVE"
      }
      action {
        type = "Delete"
      }
    }
  }

  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.noncurrent_version_expiration_days
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }

  lifecycle_rule {
    condition {
      age = var.abort_incomplete_multipart_days
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }
}

# ---------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------

resource "google_service_account" "trainer" {
  project      = var.project_id
  account_id   = "${var.name_prefix}-trainer"
  display_name = "volunteer_rl trainer (${var.bucket_name})"
}

resource "google_storage_bucket_iam_member" "trainer_objects" {
  bucket = google_storage_bucket.run.name
  role   = "roles/storage.objectAdmin"
  member = local.trainer_member
}

resource "google_storage_hmac_key" "trainer" {
  project               = var.project_id
  service_account_email = google_service_account.trainer.email
}

resource "google_service_account_key" "trainer" {
  count = var.create_service_account_keys ? 1 : 0

  service_account_id = google_service_account.trainer.name
}

# ---------------------------------------------------------------------------------------
# Volunteers
# ---------------------------------------------------------------------------------------

resource "google_service_account" "volunteer" {
  for_each = var.volunteers

  project      = var.project_id
  account_id   = "${var.name_prefix}-v-${each.key}"
  display_name = "volunteer_rl volunteer ${each.key} (${var.bucket_name})"
}

# Read the manifest and its kept copies, checkpoints, datasets and the grants of group numbers
# (another id's grants give a volunteer nothing: draws are keyed by the id). objectViewer also carries storage.objects.list,
# but a list request names the bucket, not an object, so the condition is false for it: no
# volunteer can list the bucket.
resource "google_storage_bucket_iam_member" "volunteer_read" {
  for_each = var.volunteers

  bucket = google_storage_bucket.run.name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.volunteer[each.key].email}"

  condition {
    title       = "vrl-read-${each.key}"
    description = "manifest.json, manifests/, checkpoints/, datasets/ and grants/ only"
    expression  = local.volunteer_read_condition
  }
}

# Create rollout shards under rollouts/<version>/<name>/ only. objectCreator has no delete
# permission, and Cloud Storage needs delete to replace an object, so shards are create-only.
# extract() takes the text after the template's prefix up to the first occurrence of what
# follows the variable, which may span folders: alone, `rollouts/{version}/<name>/` would let
# alice write rollouts/v1/bob/alice/x into bob's folder ({version} = "v1/bob"). The last term
# is the AWS policy's DenyOwnNameNestedInAnotherPrefix: what comes before the first
# `/<name>/` must be the first folder under rollouts/ itself.
resource "google_storage_bucket_iam_member" "volunteer_rollouts" {
  for_each = var.volunteers

  bucket = google_storage_bucket.run.name
  role   = "roles/storage.objectCreator"
  member = "serviceAccount:${google_service_account.volunteer[each.key].email}"

  condition {
    title       = "vrl-rollouts-${each.key}"
    description = "create-only under rollouts/<version>/${each.key}/"
    expression = join(" && ", [
      format("resource.name.startsWith(%q)", "${local.objects}rollouts/"),
      format("resource.name.extract(%q) != \"\"", "${local.objects}rollouts/{version}/${each.key}/"),
      format("resource.name.extract(%q) == resource.name.extract(%q)",
      "${local.objects}rollouts/{version}/${each.key}/", "${local.objects}rollouts/{version}/"),
    ])
  }
}

# The heartbeat is overwritten in place, which needs create and delete on that one object.
resource "google_storage_bucket_iam_member" "volunteer_heartbeat" {
  for_each = var.volunteers

  bucket = google_storage_bucket.run.name
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.volunteer[each.key].email}"

  condition {
    title       = "vrl-heartbeat-${each.key}"
    description = "volunteers/${each.key}.json only"
    expression  = format("resource.name == %q", "${local.objects}volunteers/${each.key}.json")
  }
}

resource "google_storage_hmac_key" "volunteer" {
  for_each = var.volunteers

  project               = var.project_id
  service_account_email = google_service_account.volunteer[each.key].email
}

resource "google_service_account_key" "volunteer" {
  for_each = var.create_service_account_keys ? var.volunteers : toset([])

  service_account_id = google_service_account.volunteer[each.key].name
}
