variable "project_id" {
  description = "Google Cloud project that owns the bucket and the service accounts."
  type        = string
}

variable "region" {
  description = "Default region of the provider."
  type        = string
  default     = "us-central1"
}

variable "location" {
  description = "Bucket location: a region (us-central1), dual-region or multi-region (US, EU)."
  type        = string
  default     = "US"
}

variable "bucket_name" {
  description = "Globally unique bucket name for the run (the rendezvous bucket)."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9_-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be 3-63 characters: lowercase letters, digits, hyphens, underscores (no dots here)."
  }
}

variable "key_prefix" {
  description = "Optional key prefix inside the bucket (\"\" or something like \"runs/calc/\"); the run then lives at gs://BUCKET/PREFIX."
  type        = string
  default     = ""

  validation {
    condition     = var.key_prefix == "" || can(regex("^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*/$", var.key_prefix))
    error_message = "key_prefix must be empty or look like \"a/b/\": no leading slash, a trailing slash."
  }
}

variable "name_prefix" {
  description = "Prefix of the service account ids (at most 7 characters, so that NAME_PREFIX-v-VOLUNTEER fits in 30)."
  type        = string
  default     = "vrl"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,6}$", var.name_prefix))
    error_message = "name_prefix must be 1-7 characters, start with a letter, lowercase letters, digits and hyphens."
  }
}

variable "volunteers" {
  description = "Names of the volunteers. Each gets its own service account, HMAC key and optional JSON key, with object-name conditions limited to rollouts/*/NAME/ and volunteers/NAME.json. The name is the --id the volunteer must run with. Remove a name and apply to revoke that volunteer."
  type        = set(string)
  default     = []

  validation {
    condition     = alltrue([for v in var.volunteers : can(regex("^[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?$", v))])
    error_message = "Each volunteer name must be 1-20 characters: lowercase letters, digits and inner hyphens."
  }
}

variable "create_service_account_keys" {
  description = "Also create a JSON service account key per identity, for native gs:// access through gcsfs. Turn off where the organisation policy iam.disableServiceAccountKeyCreation applies; HMAC keys (S3 API) still work."
  type        = bool
  default     = true
}

variable "rollout_expiration_days" {
  description = "Delete rollout shards (rollouts/) this many days after upload."
  type        = number
  default     = 14

  validation {
    condition     = var.rollout_expiration_days >= 1
    error_message = "rollout_expiration_days must be at least 1."
  }
}

variable "checkpoint_expiration_days" {
  description = "Delete checkpoint files (checkpoints/) this many days after upload; 0 keeps them forever. Set it well above the longest pause of a run: the checkpoint the manifest points to must not expire."
  type        = number
  default     = 0

  validation {
    condition     = var.checkpoint_expiration_days >= 0
    error_message = "checkpoint_expiration_days must be 0 (keep) or more."
  }
}

variable "noncurrent_version_expiration_days" {
  description = "Delete overwritten or deleted object versions this many days after they stop being live."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1
    error_message = "noncurrent_version_expiration_days must be at least 1."
  }
}

variable "abort_incomplete_multipart_days" {
  description = "Abort XML-API multipart uploads left incomplete after this many days."
  type        = number
  default     = 2

  validation {
    condition     = var.abort_incomplete_multipart_days >= 1
    error_message = "abort_incomplete_multipart_days must be at least 1."
  }
}

variable "force_destroy" {
  description = "Allow terraform destroy to delete a bucket that still holds objects."
  type        = bool
  default     = false
}

variable "labels" {
  description = "Extra labels for the bucket."
  type        = map(string)
  default     = {}
}
